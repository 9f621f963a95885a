"""How many messages/s one AMQP 1.0 connection sustains through cluster.amqp.

The server runs in this process under trio with an in-memory node (a dict of
lists, settling each publish at once); the client is Proton's own
BlockingConnection in a thread.  Printed figures:

* send, unsettled: each ``send`` waits for the server's settlement (one
  round trip per message: BlockingSender always waits).
* send, pre-settled (AtMostOnce): the client does not wait; the server still
  decodes and stores each message.
* receive: a receiver with credit, accepting each message.

Each is measured with the client in a thread of the server's process and in
a process of its own (what real clients are).

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

    def dispatch(self, address: str) -> None:
        queue = self.queues[address]
        for link in self.consumers[address]:
            while queue and link.credit > 0:
                link.send_nowait(Message(body=queue.pop(0)), token=None)

    async def on_sender_link(self, link: OutgoingLink) -> None:
        assert link.address is not None
        self.consumers[link.address].append(link)

    async def on_receiver_link(self, link: IncomingLink) -> None:
        link.flow(1000)

    async def on_message(self, link: IncomingLink, delivery: InboundDelivery) -> None:
        assert link.address is not None
        self.queues[link.address].append(delivery.message.body)
        delivery.settle(ACCEPTED)
        link.flow(1)
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


def client(port: int, n: int, size: int) -> dict[str, float]:
    body = "x" * size
    conn = BlockingConnection(f"127.0.0.1:{port}", timeout=60)
    rates = {}
    sender = conn.create_sender("bench")
    t0 = time.perf_counter()
    for _ in range(n):
        sender.send(Message(body=body))
    rates["send, unsettled (waits each settlement)"] = n / (time.perf_counter() - t0)
    fast = conn.create_sender("bench", name="bench-presettled", options=AtMostOnce())
    t0 = time.perf_counter()
    for _ in range(n):
        fast.send(Message(body=body))
    # Wait until the server holds them all: receive them below counts that.
    rates["send, pre-settled (AtMostOnce)"] = n / (time.perf_counter() - t0)
    receiver = conn.create_receiver("bench", credit=500)
    t0 = time.perf_counter()
    for _ in range(2 * n):
        receiver.receive(timeout=60)
        receiver.accept()
    rates["receive + accept, credit 500"] = 2 * n / (time.perf_counter() - t0)
    conn.close()
    return rates


async def main(n: int, size: int) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_amqp, Node(), "127.0.0.1", 0))
        for where in ("thread", "process"):
            if where == "thread":
                rates = await trio.to_thread.run_sync(client, port, n, size)
            else:
                # A client process of its own, as real clients are (no GIL shared).
                cmd = [sys.executable, __file__, "--client", str(port)]
                cmd += ["--messages", str(n), "--size", str(size)]
                done = await trio.run_process(cmd, capture_stdout=True)
                rates = json.loads(done.stdout)
            for name, rate in rates.items():
                print(f"{name:42s} {rate:8,.0f} msg/s  ({n} x {size} B, client in a {where})")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        print(json.dumps(client(args.client, args.messages, args.size)))
    else:
        trio.run(main, args.messages, args.size)
