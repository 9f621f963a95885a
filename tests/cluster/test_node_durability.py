"""A broker node with a journal (cluster/node.py, cluster/durability.py):
the AMQP header's ``durable`` reaches the state and comes back to a consumer;
a transient publish is settled once applied, a persistent one only once the
journal's commit covering it is done; what a consumer held unsettled when the
whole site went down is delivered again after its recovery, and what it may
have been sent after the last commit comes marked as possibly delivered.

A real ``BrokerNode`` on the in-memory bus, Proton's blocking client in a
worker thread; the journal's commit is held at a gate to tell the two apart,
and a power cut is a commit that writes nothing from the cut on."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from proton import Disposition, Message
from proton.utils import BlockingConnection

from cluster.addresses import Address
from cluster.bus import BusConfig
from cluster.durability import JournalSettings
from cluster.node import BrokerConfig, BrokerNode
from protocol import cluster as pc
from tests.support.membus import MemoryBus, open_memory_member

TIMEOUT_S = 20.0


@asynccontextmanager
async def journaled_broker(
    directory: Path, power_cut: threading.Event | None = None
) -> AsyncIterator[tuple[BrokerNode, int, threading.Event]]:
    """A one-node site with a journal; its commits wait for the yielded gate
    once the broker serves (set it to let them through).  Once ``power_cut``
    is set, a commit writes nothing (the disk keeps what it had then), and
    closing drops what was appended: the node stops as in a power loss."""
    config = BrokerConfig(
        cluster="site-p",
        node=1,
        bus=BusConfig(backend="embedded", group="site-p", node=1, expect_brokers=1),
        amqp=Address("127.0.0.1", 0),
        journal=JournalSettings(str(directory)),
    )
    node = BrokerNode(config, open_member=open_memory_member(MemoryBus()))
    assert node.durability is not None
    journal = node.durability.journal
    gate = threading.Event()
    gate.set()
    commit = journal.commit

    def gated_commit() -> int:
        gate.wait(TIMEOUT_S)
        if power_cut is not None and power_cut.is_set():
            return journal.durable_cseq
        return commit()

    journal.commit = gated_commit  # type: ignore[method-assign]
    try:
        with trio.fail_after(TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                port: int = await nursery.start(node.serve)
                yield node, port, gate
                nursery.cancel_scope.cancel()
    finally:
        gate.set()


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def connect(port: int) -> BlockingConnection:
    return BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=TIMEOUT_S)


def declare(port: int, name: str, **args: Any) -> None:
    conn = connect(port)
    try:
        sender = conn.create_sender("$drgate.admin")
        request = {"op": "add-queue", "name": name, "args": args}
        delivery = sender.send(Message(body=json.dumps(request)), error_states=[])
        assert delivery.remote_state == Disposition.ACCEPTED
    finally:
        conn.close()


def send(port: int, queue: str, body: str, *, durable: bool, **properties: Any) -> bool:
    """Publish one message; True once the broker accepted it."""
    conn = connect(port)
    try:
        sender = conn.create_sender(queue)
        message = Message(body=body, durable=durable, properties=properties or None)
        return bool(sender.send(message, error_states=[]).remote_state == Disposition.ACCEPTED)
    finally:
        conn.close()


def take(port: int, queue: str, count: int) -> list[Message]:
    """Receive ``count`` messages of ``queue``, accepting each."""
    conn = connect(port)
    try:
        receiver = conn.create_receiver(queue, credit=10)
        got = []
        for _ in range(count):
            got.append(receiver.receive(timeout=TIMEOUT_S))
            receiver.accept()
        return got
    finally:
        conn.close()


async def wait_for(check: Callable[[], bool]) -> None:
    """Poll the node's state (it has no event to wait on) up to a deadline."""
    with trio.fail_after(TIMEOUT_S):
        while not check():  # noqa: ASYNC110
            await trio.sleep(0.01)


def messages(node: BrokerNode, queue: str) -> list[Any]:
    return list(node.member.state.queues[queue].messages.values())


async def test_a_transient_publish_settles_at_once_a_persistent_one_after_its_commit(
    tmp_path: Path,
) -> None:
    async with journaled_broker(tmp_path / "journal") as (node, port, gate):
        await in_thread(lambda: declare(port, "keep", durable=True))
        await in_thread(lambda: declare(port, "temp"))
        assert node.durability is not None
        gate.clear()  # from here no commit completes
        # Transient (by header, or by queue): accepted with the disk held.
        assert await in_thread(lambda: send(port, "keep", "t1", durable=False))
        assert await in_thread(lambda: send(port, "temp", "t2", durable=True))
        # Persistent: applied, but not settled while its commit waits.
        accepted: list[bool] = []

        async def persistent() -> None:
            accepted.append(await in_thread(lambda: send(port, "keep", "p1", durable=True)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(persistent)
            await wait_for(lambda: len(messages(node, "keep")) == 2)
            await wait_for(lambda: len(node.durability._unsettled) == 1)  # type: ignore[union-attr]
            assert accepted == []
            gate.set()
        assert accepted == [True]


async def test_the_durable_header_reaches_the_state_and_comes_back_to_the_consumer(
    tmp_path: Path,
) -> None:
    async with journaled_broker(tmp_path / "journal") as (node, port, _gate):
        await in_thread(lambda: declare(port, "keep", durable=True))
        # A client's application property of the reserved name does not count.
        await in_thread(lambda: send(port, "keep", "a", durable=True))
        await in_thread(
            lambda: send(port, "keep", "b", durable=False, **{pc.DURABLE_PROPERTY: True})
        )
        props = [m.properties for m in messages(node, "keep")]
        assert props == [{pc.DURABLE_PROPERTY: True}, None]

        got = await in_thread(lambda: take(port, "keep", 2))
        assert [(m.body, bool(m.durable)) for m in got] == [("a", True), ("b", False)]


async def test_what_a_consumer_held_when_the_site_went_down_is_delivered_after_the_recovery(
    tmp_path: Path,
) -> None:
    # Chaos, CI (seed 596846293): D restarted whole while a consumer held 39
    # messages; after the recovery they stayed acquired by that consumer's
    # session of the old site, counted in the depth and never delivered.
    directory = tmp_path / "journal"
    held: list[BlockingConnection] = []
    async with journaled_broker(directory) as (node, port, _gate):
        await in_thread(lambda: declare(port, "keep", durable=True))
        for body in ("a", "b"):
            await in_thread(lambda body=body: send(port, "keep", body, durable=True))

        def hold_two() -> list[str]:
            # A short timeout: closing it once its broker is gone waits that long.
            conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=1)
            held.append(conn)
            receiver = conn.create_receiver("keep", credit=2)
            return [receiver.receive(timeout=TIMEOUT_S).body for _ in range(2)]

        assert await in_thread(hold_two) == ["a", "b"]  # never settled
        await wait_for(lambda: len(node.member.state.queues["keep"].acquired) == 2)
        journal = node.durability.journal  # type: ignore[union-attr]
        await wait_for(lambda: journal.durable_cseq >= node.member.state.cseq)  # on disk
    with contextlib.suppress(Exception):  # its broker is gone
        held[0].close()

    async with journaled_broker(directory) as (node, port, _gate):
        await wait_for(lambda: node.member.state.incarnation != 0)  # recovered
        assert node.member.state.sessions == {}
        me = node.member.me
        assert me is not None and list(node.member.state.ready) == [(me.node, me.pid)]
        await in_thread(lambda: send(port, "keep", "c", durable=True))

        got = await in_thread(lambda: take(port, "keep", 3))
        # In order; the two that went out before the restart say so.
        assert [(m.body, m.delivery_count) for m in got] == [("a", 1), ("b", 1), ("c", 0)]


async def test_what_went_out_after_the_last_commit_comes_marked_after_a_power_loss(
    tmp_path: Path,
) -> None:
    # Chaos, CI (seed 1415117289): a P consumer received messages, then the
    # whole site lost power before the commit of their acquisitions; the
    # recovered site delivered them again with a delivery count of 0, though
    # they may have been processed.  Nothing on disk says they went out, so
    # after a power loss every recovered message may have.
    directory = tmp_path / "journal"
    power_cut = threading.Event()
    held: list[BlockingConnection] = []
    async with journaled_broker(directory, power_cut) as (node, port, _gate):
        await in_thread(lambda: declare(port, "keep", durable=True))
        for body in ("a", "b", "c"):
            await in_thread(lambda body=body: send(port, "keep", body, durable=True))
        journal = node.durability.journal  # type: ignore[union-attr]
        await wait_for(lambda: journal.durable_cseq >= node.member.state.cseq)  # on disk
        power_cut.set()  # from here the disk takes nothing

        def hold_two() -> list[str]:
            conn = BlockingConnection(f"amqp://127.0.0.1:{port}", timeout=1)
            held.append(conn)
            receiver = conn.create_receiver("keep", credit=2)
            return [receiver.receive(timeout=TIMEOUT_S).body for _ in range(2)]

        assert await in_thread(hold_two) == ["a", "b"]  # sent, never settled
        assert journal.durable_cseq < node.member.state.cseq  # the acquisitions: not on disk
    with contextlib.suppress(Exception):  # its broker is gone
        held[0].close()

    async with journaled_broker(directory) as (node, port, _gate):
        await wait_for(lambda: node.member.state.incarnation != 0)  # recovered
        await in_thread(lambda: send(port, "keep", "d", durable=True))
        got = await in_thread(lambda: take(port, "keep", 4))
        # What the site held at the cut may have gone out; what came after not.
        assert [(m.body, m.delivery_count) for m in got] == [
            ("a", 1),
            ("b", 1),
            ("c", 1),
            ("d", 0),
        ]
