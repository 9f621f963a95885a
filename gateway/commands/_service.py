"""What the long-running commands (``drgate broker``, ``drgate run``) share:
their options, the metrics server beside the service, and the stop on a signal."""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import trio

from cluster.addresses import Address
from cluster.webconfig import WebConfig
from gateway.logs import FORMATS

if TYPE_CHECKING:  # the metrics server is imported only when one is configured
    from gateway.metrics import SnapshotFunction

# After SIGTERM, give open work this long to finish before exiting.
SHUTDOWN_GRACE_S = 5.0


def configure_service(parser: argparse.ArgumentParser, *, config_help: str) -> None:
    """``--config FILE`` (described by ``config_help``), ``--log-level``, ``--log-format``."""
    parser.add_argument("--config", required=True, metavar="FILE", help=config_help)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    parser.add_argument(
        "--log-format", default="kv", choices=list(FORMATS), help="log lines: key=value or JSON"
    )


async def start_metrics(
    nursery: trio.Nursery,
    address: Address,
    snapshot: SnapshotFunction,
    *,
    command: str,
    web: WebConfig | None = None,
) -> None:
    """Serve ``/metrics`` and ``/status`` of ``snapshot`` at ``address`` in
    ``nursery``, with the TLS and basic auth of ``web`` (None: plain HTTP),
    and print ``drgate COMMAND: metrics on HOST:PORT`` once bound (the lab
    reads the port from that line)."""
    from gateway.httpserver import serve_http

    bound = await nursery.start(
        functools.partial(serve_http, address.host, address.port, snapshot=snapshot, web=web)
    )
    print(f"drgate {command}: metrics on {Address(address.host, bound)}", flush=True)


async def stop_on_signal(
    signals: AsyncIterator[int], nursery: trio.Nursery, *, log: logging.Logger | None = None
) -> None:
    """At the first of ``signals``, cancel ``nursery`` with a deadline of
    ``SHUTDOWN_GRACE_S`` for its tasks' clean-up."""
    async for _ in signals:
        if log is not None:
            log.info("signal received, stopping")
        nursery.cancel_scope.deadline = trio.current_time() + SHUTDOWN_GRACE_S
        nursery.cancel_scope.cancel()
        break
