"""What the DR site's admin commands (``drgate promote``, ``drgate resync``)
share: a D sidecar's config names the site and its bus, and the primary
defaults to that config's ``peer_cluster``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from gateway.config import load_sidecar_config
from gateway.netns import enter_bus_netns
from protocol.errors import DrgateError

if TYPE_CHECKING:
    from gateway.sidecarconfig import SidecarConfig


def configure_dr_site(parser: argparse.ArgumentParser, *, origin_help: str) -> None:
    """``--config FILE`` (a D sidecar's) and ``--origin CLUSTER``."""
    parser.add_argument(
        "--config", required=True, metavar="FILE", help="a D sidecar's config (bus and site)"
    )
    parser.add_argument(
        "--origin", metavar="CLUSTER", help=f"{origin_help} (default: peer_cluster)"
    )


def load_dr_site(args: argparse.Namespace, *, command: str) -> tuple[SidecarConfig, str]:
    """The D sidecar config of ``args.config`` and the primary (``args.origin``
    or its ``peer_cluster``); raises DrgateError for a primary site's config."""
    config = load_sidecar_config(args.config)
    if config.primary:
        raise DrgateError(
            f"{args.config} is the config of a primary-site sidecar ({config.site}); "
            f"run drgate {command} with a DR site's sidecar config"
        )
    enter_bus_netns(config.bus)
    return config, args.origin or config.peer_cluster
