"""``drgate run --config sidecar.yaml``: run one sidecar beside a broker node."""

from __future__ import annotations

import argparse
import functools
import logging
import signal

import trio

from gateway.commands._service import configure_service, start_metrics, stop_on_signal
from gateway.config import load_sidecar_config
from gateway.logs import configure_logging
from gateway.sidecar import Sidecar
from gateway.sidecarconfig import SidecarConfig

NAME = "run"
HELP = "run a sidecar: tap and egress at the primary site, ingress at the DR site"


def configure(parser: argparse.ArgumentParser) -> None:
    configure_service(parser, config_help="sidecar config (YAML)")


def run(args: argparse.Namespace) -> int:
    config = load_sidecar_config(args.config)
    configure_logging(args.log_format, args.log_level, site=config.site, node=config.node)
    trio.run(functools.partial(serve_sidecar, config, log_format=args.log_format))
    return 0


async def serve_sidecar(config: SidecarConfig, *, log_format: str | None = None) -> None:
    sidecar = Sidecar(config)
    if log_format is not None:
        # Now that the sidecar exists, every line carries its current role.
        configure_logging(
            log_format,
            logging.getLogger().level,
            site=config.site,
            node=config.node,
            role_getter=sidecar.current_role,
        )
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(sidecar.serve)
            if config.metrics is not None:
                await start_metrics(
                    nursery,
                    config.metrics,
                    sidecar.statistics,
                    command="run",
                    web=config.metrics_web,
                )
            if sidecar.link_port is not None:
                print(f"drgate run: link listening on port {sidecar.link_port}", flush=True)
            print(
                f"drgate run: sidecar node {config.node} of {config.site} ready, "
                f"role {sidecar.current_role()}",
                flush=True,
            )
            await stop_on_signal(signals, nursery)
