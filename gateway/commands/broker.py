"""``drgate broker --config FILE``: run one broker node of a site."""

from __future__ import annotations

import argparse
import logging
import signal

import trio

from cluster.node import BrokerConfig, BrokerNode
from gateway.config import load_broker_config

NAME = "broker"
HELP = "run a broker node: joins the site bus and serves AMQP 1.0 clients"
# After SIGTERM, give open work this long to finish before exiting.
SHUTDOWN_GRACE_S = 5.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="broker config (YAML)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])


def run(args: argparse.Namespace) -> int:
    config = load_broker_config(args.config)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s level=%(levelname)s site={config.cluster} node={config.node} "
        "role=broker %(name)s: %(message)s",
    )
    trio.run(serve_broker, config)
    return 0


async def serve_broker(config: BrokerConfig) -> None:
    node = BrokerNode(config)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(node.serve)
            print(
                f"drgate broker: node {config.node} of {config.cluster} ready, amqp port {port}",
                flush=True,
            )
            async for _ in signals:
                logging.getLogger("drgate.broker").info("signal received, stopping")
                nursery.cancel_scope.deadline = trio.current_time() + SHUTDOWN_GRACE_S
                nursery.cancel_scope.cancel()
                break
