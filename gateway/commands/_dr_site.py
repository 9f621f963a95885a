"""What the DR site's admin commands (``drgate promote``, ``drgate resync``)
share: a D sidecar's config names the site and its bus, and the primary
defaults to that config's ``peer_cluster``.  With configs that link both
ways, the DR site is whichever site is not the primary now (the sites may
have swapped roles): the command checks once it holds the site's state."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cluster.state.model import SiteState
from gateway.config import load_sidecar_config
from gateway.netns import enter_bus_netns
from gateway.roles import runs_as_primary
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
    or its ``peer_cluster``); raises DrgateError for a primary site's config
    (one that links both ways is checked by :func:`check_dr_now`)."""
    config = load_sidecar_config(args.config)
    if config.primary and not config.reversible:
        raise DrgateError(
            f"{args.config} is the config of a primary-site sidecar ({config.site}); "
            f"run drgate {command} with a DR site's sidecar config"
        )
    enter_bus_netns(config.bus)
    return config, args.origin or config.peer_cluster


def check_dr_now(config: SidecarConfig, state: SiteState, *, command: str) -> None:
    """Refuse to run ``drgate COMMAND`` at a site that is the primary now."""
    if runs_as_primary(state, configured=config.primary, reversible=config.reversible):
        raise DrgateError(
            f"{config.site} is the primary now ({config.peer_cluster} is its DR site): run "
            f"drgate {command} at {config.peer_cluster}, with one of its sidecars' configs"
        )
