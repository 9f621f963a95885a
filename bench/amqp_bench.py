"""How many messages/s one AMQP 1.0 connection sustains through cluster.amqp.

The server runs in this process under trio with an in-memory node (a dict of
lists, settling each publish at once); the client is Proton's own
BlockingConnection in a thread.  Printed figures:

* send, unsettled: each ``send`` waits for the server's settlement (one
  round trip per message: BlockingSender always waits).
* send, pre-settled (AtMostOnce): the client does not wait; the server still
  decodes and stores each message.
* receive: a receiver with credit, accepting each message.

Each is measured with the client in a thread of the server's process, then
with each figure's client in a process of its own (what real clients are);
for those the server's CPU per message (this process's user + system time)
and its pump passes per message are printed too, twice: publishes settled
inside ``on_message``, and settled from another task, as the broker node
settles a publish once its command comes back from the bus.

Usage: .venv/bin/python bench/amqp_bench.py [--messages N] [--size BYTES]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import trio
from proton import Message
from proton.reactor import AtMostOnce
from proton.utils import BlockingConnection

from cluster.amqp import (
    ACCEPTED,
    AmqpConnection,
    InboundDelivery,
    IncomingLink,
    Outcome,
    OutgoingLink,
)
from cluster.amqpserver import serve_amqp


class Node:
    def __init__(self) -> None:
        self.queues: dict[str, list[Any]] = defaultdict(list)
        self.consumers: dict[str, list[OutgoingLink]] = defaultdict(list)
        self.connections: list[AmqpConnection] = []
        # Set: publishes are settled by the task reading this channel.
        self.settler: trio.MemorySendChannel[InboundDelivery] | None = None

    def dispatch(self, address: str) -> None:
        queue = self.queues[address]
        for link in self.consumers[address]:
            while queue and link.credit > 0:
                link.send_nowait(Message(body=queue.pop(0)), token=None)

    async def on_sender_link(self, link: OutgoingLink) -> None:
        assert link.address is not None
        self.connections.append(link.connection)
        self.consumers[link.address].append(link)

    async def on_receiver_link(self, link: IncomingLink) -> None:
        self.connections.append(link.connection)
        link.flow(1000)

    async def on_message(self, link: IncomingLink, delivery: InboundDelivery) -> None:
        assert link.address is not None
        self.queues[link.address].append(delivery.message.body)
        if self.settler is not None:
            self.settler.send_nowait(delivery)
        else:
            settle(delivery)
        self.dispatch(link.address)

    async def on_credit(self, link: OutgoingLink, credit: int) -> None:
        assert link.address is not None
        self.dispatch(link.address)

    async def on_outcomes(
        self, link: OutgoingLink, outcomes: Sequence[tuple[object, Outcome]]
    ) -> None:
        pass

    async def on_close_asked(self, conn: AmqpConnection) -> None:
        pass

    async def on_link_closed(self, link: OutgoingLink | IncomingLink) -> None:
        if isinstance(link, OutgoingLink) and link.address is not None:
            self.consumers[link.address].remove(link)

    async def on_connection_closed(self, conn: AmqpConnection) -> None:
        pass


def settle(delivery: InboundDelivery) -> None:
    delivery.settle(ACCEPTED)
    delivery.link.flow(1)


async def settle_loop(receive: trio.MemoryReceiveChannel[InboundDelivery]) -> None:
    async for delivery in receive:
        settle(delivery)


PHASES = (
    "send, unsettled (waits each settlement)",
    "send, pre-settled (AtMostOnce)",
    "receive + accept, credit 500",
)


def client(port: int, n: int, size: int, phases: Sequence[str] = PHASES) -> dict[str, float]:
    body = "x" * size
    conn = BlockingConnection(f"127.0.0.1:{port}", timeout=60)
    rates = {}
    if PHASES[0] in phases:
        sender = conn.create_sender("bench")
        t0 = time.perf_counter()
        for _ in range(n):
            sender.send(Message(body=body))
        rates[PHASES[0]] = n / (time.perf_counter() - t0)
    if PHASES[1] in phases:
        fast = conn.create_sender("bench", name="bench-presettled", options=AtMostOnce())
        t0 = time.perf_counter()
        for _ in range(n):
            fast.send(Message(body=body))
        rates[PHASES[1]] = n / (time.perf_counter() - t0)
    if PHASES[2] in phases:
        receiver = conn.create_receiver("bench", credit=500)
        t0 = time.perf_counter()
        for _ in range(n):
            receiver.receive(timeout=60)
            receiver.accept()
        rates[PHASES[2]] = n / (time.perf_counter() - t0)
    conn.close()
    return rates


async def main(n: int, size: int) -> None:
    node = Node()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_amqp, node, "127.0.0.1", 0))
        rates = await trio.to_thread.run_sync(client, port, n, size)
        for name, rate in rates.items():
            print(f"{name:42s} {rate:8,.0f} msg/s  ({n} x {size} B, client in a thread)")
        for settler in ("on_message", "another task"):
            if settler != "on_message":
                node.settler, receive = trio.open_memory_channel[InboundDelivery](10_000)
                nursery.start_soon(settle_loop, receive)
            for phase in PHASES:
                # A client process of its own, as real clients are (no GIL shared).
                cmd = [sys.executable, __file__, "--client", str(port), "--phase", phase]
                cmd += ["--messages", str(n), "--size", str(size)]
                cpu0, node.connections = time.process_time(), []
                done = await trio.run_process(cmd, capture_stdout=True)
                cpu_us = (time.process_time() - cpu0) * 1e6 / n
                cycles = sum(c.statistics_pump_cycles for c in node.connections) / n
                (rate,) = json.loads(done.stdout).values()
                print(
                    f"{phase:42s} {rate:8,.0f} msg/s  ({n} x {size} B, client in a process; "
                    f"server {cpu_us:.0f} us CPU, {cycles:.2f} pump passes per message, "
                    f"publishes settled in {settler})"
                )
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        print(json.dumps(client(args.client, args.messages, args.size, [args.phase])))
    else:
        trio.run(main, args.messages, args.size)
