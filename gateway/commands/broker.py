"""``drgate broker --config FILE``: run one broker node of a site."""

from __future__ import annotations

import argparse
import functools
import logging
import signal

import trio

from cluster.node import BrokerConfig, BrokerNode
from gateway.config import load_broker_config
from gateway.logs import FORMATS, configure_logging

NAME = "broker"
HELP = "run a broker node: joins the site bus and serves AMQP 1.0 clients"
# After SIGTERM, give open work this long to finish before exiting.
SHUTDOWN_GRACE_S = 5.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="broker config (YAML)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    parser.add_argument(
        "--log-format", default="kv", choices=list(FORMATS), help="log lines: key=value or JSON"
    )


def run(args: argparse.Namespace) -> int:
    config = load_broker_config(args.config)
    configure_logging(
        args.log_format,
        args.log_level,
        site=config.cluster,
        node=config.node,
        role_getter=lambda: "broker",
    )
    trio.run(serve_broker, config)
    return 0


async def serve_broker(config: BrokerConfig) -> None:
    node = BrokerNode(config)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(node.serve)
            if config.metrics is not None:
                from gateway.httpserver import serve_http

                host, _, metrics_port = config.metrics.rpartition(":")
                bound = await nursery.start(
                    functools.partial(
                        serve_http, host.strip("[]"), int(metrics_port), snapshot=node.statistics
                    )
                )
                print(f"drgate broker: metrics on {host}:{bound}", flush=True)
            print(
                f"drgate broker: node {config.node} of {config.cluster} ready, amqp port {port}",
                flush=True,
            )
            async for _ in signals:
                logging.getLogger("drgate.broker").info("signal received, stopping")
                nursery.cancel_scope.deadline = trio.current_time() + SHUTDOWN_GRACE_S
                nursery.cancel_scope.cancel()
                break
