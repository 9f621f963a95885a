"""One broker node serving one consumer, in one process: the delivery path's
cost without the bus's or the other processes' (``make bench-deliver``).

A ``BrokerNode`` on the in-memory bus (tests/support/membus.py) holds COUNT
messages of ~60 bytes; a Proton ``Container`` consumer in a worker thread
(prefetch 200, accepting each) takes them all.  Prints the wall time and the
process's CPU per message (the client's included), and with ``--profile``
the broker thread's top functions (cProfile: it slows the run down).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import trio
from proton import Message
from proton.handlers import MessagingHandler
from proton.reactor import Container

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.addresses import Address
from cluster.bus import BusConfig
from cluster.node import BrokerConfig, BrokerNode
from protocol import cluster as pc
from tests.support.membus import MemoryBus, open_memory_member

BATCH = 500


class Consumer(MessagingHandler):  # type: ignore[misc]
    def __init__(self, port: int, count: int) -> None:
        super().__init__(prefetch=200, auto_accept=True)
        self.port, self.count, self.received = port, count, 0

    def on_start(self, event: Any) -> None:
        conn = event.container.connect(f"127.0.0.1:{self.port}", reconnect=False)
        event.container.create_receiver(conn, "q")

    def on_message(self, event: Any) -> None:
        self.received += 1
        if self.received == self.count:
            event.connection.close()


async def run(count: int, profile: bool) -> None:
    config = BrokerConfig(
        cluster="site-p",
        node=1,
        bus=BusConfig(backend="embedded", group="site-p", node=1),
        amqp=Address("127.0.0.1", 0),
    )
    node = BrokerNode(config, open_member=open_memory_member(MemoryBus()))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(node.serve)
        await node.member.submit_and_wait(pc.QueueDeclare("q", {}))
        body = Message(body="hello12345", id="x", properties={"sent_at": 1.0}).encode()
        for first in range(0, count, BATCH):
            n = min(BATCH, count - first)
            await node.member.submit_and_wait(
                *[pc.Publish("", "q", body, str(first + i), {}, 0) for i in range(n)]
            )
        profiler = cProfile.Profile() if profile else None
        cpu, wall = time.process_time(), time.monotonic()
        if profiler is not None:
            profiler.enable()
        consumer = Consumer(port, count)
        await trio.to_thread.run_sync(Container(consumer).run)
        if profiler is not None:
            profiler.disable()
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        print(
            f"{consumer.received} delivered in {wall:.2f} s ({consumer.received / wall:,.0f}/s); "
            f"process CPU {cpu / count * 1e6:.0f} us a message (the client's included)"
        )
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/broker_deliver.py", description=__doc__)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    trio.run(run, args.count, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
