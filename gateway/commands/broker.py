"""``drgate broker --config FILE``: run one broker node of a site."""

from __future__ import annotations

import argparse
import logging
import signal

import trio

from cluster.node import BrokerConfig, BrokerNode
from gateway.brokerconfig import load_broker_config
from gateway.commands._service import configure_service, start_metrics, stop_on_signal
from gateway.logs import configure_logging

NAME = "broker"
HELP = "run a broker node: joins the site bus and serves AMQP 1.0 clients"


def configure(parser: argparse.ArgumentParser) -> None:
    configure_service(parser, config_help="broker config (YAML)")


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
                await start_metrics(
                    nursery,
                    config.metrics,
                    node.statistics,
                    command="broker",
                    web=config.metrics_web,
                )
            print(
                f"drgate broker: node {config.node} of {config.cluster} ready, amqp port {port}",
                flush=True,
            )
            await stop_on_signal(signals, nursery, log=logging.getLogger("drgate.broker"))
