"""The bus-member core (cluster/member): the observer contract, post, joining.

Members run in this process on an embedded bus whose sequencer runs here too
(loopback TCP, no other process).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio

from cluster import state as st
from cluster.bus import BusConfig, MemberId, ViewChange
from cluster.member import CHUNK_BYTES, COMMAND_QUEUE, MemberObserver, NullObserver, SiteMember
from cluster.state.effects import Effect
from protocol import cluster as pc
from protocol.modes import Role
from tests.support.embeddedbus import open_embedded_site

DEADLINE_S = 120  # a guard against a hang, not a speed test: loopback TCP on a busy machine


class Recorder:
    """Records every hook, and the state's cseq each command was told at."""

    def __init__(self) -> None:
        self.member: SiteMember | None = None
        self.calls: list[tuple[Any, ...]] = []
        self.changed = trio.Event()  # set, and replaced, at every call

    def after_command(
        self, cmd: pc.Command, effects: Sequence[Effect], sender: MemberId, own: bool
    ) -> None:
        assert self.member is not None
        self.record("command", type(cmd).__name__, own, self.member.state.cseq)

    def after_frame(self) -> None:
        self.record("frame")

    def after_view(self, view: ViewChange, effects: Sequence[Effect]) -> None:
        self.record("view", view.members, list(effects))

    def view_seen(self, view: ViewChange) -> None:
        self.record("seen", view.members)

    def on_rejoin(self) -> None:
        self.record("rejoin")

    def after_restore(self) -> None:
        self.record("restore")

    def record(self, *call: Any) -> None:
        self.calls.append(call)
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, call: tuple[Any, ...]) -> None:
        with trio.fail_after(DEADLINE_S):
            while call not in self.calls:
                await self.changed.wait()

    def kinds(self) -> list[Any]:
        return [c[0] if c[0] != "command" else c[1] for c in self.calls]


@contextlib.asynccontextmanager
async def open_site(group: str = "site") -> AsyncIterator[tuple[trio.Nursery, BusConfig]]:
    async with open_embedded_site(group) as site:
        yield site.nursery, site.bus


async def start(nursery: trio.Nursery, bus: BusConfig, observer: MemberObserver) -> SiteMember:
    member = SiteMember("P", bus, role=Role.BROKER, observer=observer)
    if isinstance(observer, Recorder):
        observer.member = member
    with trio.fail_after(DEADLINE_S):
        await nursery.start(member.serve)
    return member


async def test_observer_hears_the_stream_in_order_after_it_is_applied() -> None:
    first, second = Recorder(), Recorder()
    async with open_site() as (nursery, bus):
        a = await start(nursery, bus, first)
        assert a.me is not None
        # Genesis: the join view is applied, then our own Genesis and MemberReady.
        assert first.kinds()[:2] == ["seen", "view"]
        with trio.fail_after(DEADLINE_S):
            await a.submit_and_wait(pc.QueueDeclare("q"))
        assert {"Genesis", "MemberReady", "QueueDeclare"} <= set(first.kinds())
        assert all(c[2] for c in first.calls if c[0] == "command")  # all own
        cseqs = [c[3] for c in first.calls if c[0] == "command"]
        assert cseqs == list(range(1, len(cseqs) + 1))  # told after each was applied
        assert first.kinds()[-1] == "frame"

        first.calls.clear()
        b = await start(nursery, bus, second)
        # The joiner buffered from its join view and took a's snapshot.
        assert second.kinds()[:2] == ["seen", "restore"]
        assert b.state.queues.keys() == {"q"}
        assert st.digest(b.state) == st.digest(a.state)
        assert first.calls[:2] == [("seen", (a.me, b.me)), ("view", (a.me, b.me), [])]

        first.calls.clear()
        second.calls.clear()
        with trio.fail_after(DEADLINE_S):
            await b.submit_and_wait(pc.QueueDeclare("r"))
        assert ("command", "QueueDeclare", True, b.state.cseq) in second.calls
        await first.wait_for(("command", "QueueDeclare", False, b.state.cseq))
        assert "r" in a.state.queues


async def test_post_never_waits_and_what_it_spills_is_multicast_before_a_later_barrier() -> None:
    async with open_site() as (nursery, bus):
        member = await start(nursery, bus, NullObserver())
        count = 2 * COMMAND_QUEUE + 1
        # No checkpoint in this loop: the multicaster cannot drain meanwhile,
        # so the channel fills and the rest is spilled.
        for i in range(count):
            member.post(pc.QueueDeclare(f"q{i}"))
        with trio.fail_after(DEADLINE_S):
            await member.submit_and_wait()
        assert sum(name.startswith("q") for name in member.state.queues) == count


async def test_commands_submitted_in_one_pass_leave_in_one_frame() -> None:
    # A broker submits each publish of a socket read with its own
    # ``await submit``; they must not leave one frame each (every frame costs
    # every member of the site a socket read, and the bus a write to each).
    recorder = Recorder()
    async with open_site() as (nursery, bus):
        member = await start(nursery, bus, recorder)
        with trio.fail_after(DEADLINE_S):
            await member.submit_and_wait()  # its joining commands are applied
        recorder.calls.clear()
        for i in range(50):
            await member.submit(pc.QueueDeclare(f"q{i}"))
        with trio.fail_after(DEADLINE_S):
            await member.submit_and_wait()
        assert recorder.kinds().count("QueueDeclare") == 50
        assert recorder.kinds().count("frame") == 1


async def test_a_joiner_takes_a_snapshot_of_several_chunks() -> None:
    async with open_site() as (nursery, bus):
        a = await start(nursery, bus, NullObserver())
        with trio.fail_after(DEADLINE_S):
            await a.submit_and_wait(pc.QueueDeclare("big", {"blob": b"x" * (2 * CHUNK_BYTES)}))
        recorder = Recorder()
        b = await start(nursery, bus, recorder)
        assert recorder.kinds().count("restore") == 1
        assert st.digest(b.state) == st.digest(a.state)
        assert b.state.queues["big"].args == {"blob": b"x" * (2 * CHUNK_BYTES)}


async def test_encoded_frames_are_applied_everywhere_in_order_with_submitted_commands() -> None:
    async with open_site() as (nursery, bus):
        a = await start(nursery, bus, NullObserver())
        b = await start(nursery, bus, NullObserver())
        frames = [c_frame(pc.Publish("", "q", f"m-{i}".encode(), f"m-{i}")) for i in range(450)]
        with trio.fail_after(DEADLINE_S):
            await a.submit_and_wait(pc.QueueDeclare("q"))
            await a.submit(pc.Publish("", "q", b"before", "before"))
            await a.submit_frames_and_wait(frames)
            await a.submit_and_wait(pc.Publish("", "q", b"after", "after"))
            await a.submit_frames_and_wait([])  # nothing to send: returns at once
        bodies = [bytes(m.body) for m in st.messages(a.state, "q")]
        assert bodies == [b"before", *(f"m-{i}".encode() for i in range(450)), b"after"]
        with trio.fail_after(DEADLINE_S):
            await b.submit_and_wait()  # sequenced after all of a's: b has applied them
        assert st.digest(b.state) == st.digest(a.state)


def c_frame(*commands: pc.Command) -> bytes:
    return pc.encode_frame(list(commands))


# ---------------------------------------------------------------------------
# A broker restarted with its journal rejoins from it plus the delta.
# ---------------------------------------------------------------------------

DURABLE = {pc.DURABLE_PROPERTY: True}


def persistent_publishes(queue: str, n: int, tag: str) -> list[pc.Command]:
    return [
        pc.Publish("", queue, f"{tag}-{i:06d}".encode() * 20, f"{tag}-{i}", DURABLE)
        for i in range(n)
    ]


async def restart_with_journal(
    nursery: trio.Nursery, bus: BusConfig, recovered: st.SiteState
) -> SiteMember:
    member = SiteMember("P", bus, role=Role.BROKER, observer=NullObserver())
    member.recovered = recovered
    with trio.fail_after(DEADLINE_S):
        await nursery.start(member.serve)
    return member


async def run_and_restart(change_while_gone: list[pc.Command]) -> tuple[SiteMember, SiteMember]:
    """A and C run; B joins, holds 10,000 persistent messages, stops (its
    recovered state is what it held), the site applies ``change_while_gone``
    and more messages, and B restarts with that state: (A, B again)."""
    async with open_site() as (nursery, bus):
        a = await start(nursery, bus, NullObserver())
        c = await start(nursery, bus, NullObserver())
        with trio.fail_after(DEADLINE_S):
            await a.submit_and_wait(pc.QueueDeclare("orders", {"durable": True}))
            await a.submit_and_wait(*persistent_publishes("orders", 10_000, "old"))
        async with trio.open_nursery() as gone:
            b = await start(gone, bus, NullObserver())
            with trio.fail_after(DEADLINE_S):
                await b.submit_and_wait()
            journal = st.restore_untrusted(st.snapshot(b.state))
            gone.cancel_scope.cancel()
        with trio.fail_after(DEADLINE_S):
            await c.submit_and_wait(*change_while_gone, *persistent_publishes("orders", 50, "new"))
        b = await restart_with_journal(nursery, bus, journal)
        with trio.fail_after(DEADLINE_S):
            await b.submit_and_wait()
            await a.submit_and_wait()
        assert st.snapshot(b.state) == st.snapshot(a.state) == st.snapshot(c.state)
        nursery.cancel_scope.cancel()
    return a, b


async def test_a_broker_restarted_with_its_journal_takes_only_the_delta() -> None:
    a, b = await run_and_restart([pc.Accept("orders", 0, ())])
    donated = a.transfers
    # A (the lowest) served C, B's first join and B's restart.
    assert donated.donations == 3
    # The restart left the 10,000 bodies it holds to its journal: the delta
    # is a fraction of the full transfer.
    assert donated.bodies_left == 10_000
    assert donated.bytes_saved == 10_000 * (200 - 4)  # a length and CRC32 instead of a body
    assert (b.transfers.restores, b.transfers.fallbacks) == (1, 0)
    assert b.transfers.bytes_received < donated.bytes_saved / 2


async def test_a_queue_deleted_and_declared_again_while_it_was_gone_makes_it_take_everything() -> (
    None
):
    again = [
        pc.QueueDelete("orders"),
        pc.QueueDeclare("orders", {"durable": True}),
        *persistent_publishes("orders", 100, "again"),
    ]
    a, b = await run_and_restart(again)
    # The first delta's bodies failed their CRC check: B asked again and took
    # a full transfer (positions 1..150 of the new queue are other messages).
    assert b.transfers.fallbacks == 1
    assert b.transfers.restores == 1
    assert a.transfers.donations == 4  # C, B, B's delta, B's full transfer


def test_a_broker_offers_the_state_it_held_when_it_is_ahead_of_its_journal() -> None:
    # A broker that rejoins a site still recovering (or whose site starts
    # over) offers what it held: its journal as recovered at its start is
    # older (chaos seed 2025: the site went on from a node's stale state).
    bus = BusConfig("embedded", "site", 1)
    broker = SiteMember("site-d", bus, role=Role.BROKER, observer=NullObserver())
    journal, held = st.new_state(), st.new_state()
    for state, count in ((journal, 2), (held, 5)):
        st.apply(state, pc.Genesis("site-d", 7))
        for n in range(count):
            st.apply(state, pc.QueueDeclare(f"q{n}"))
    broker.recovered = journal
    broker.offer_held(held)
    assert broker.recovered is held
    broker.offer_held(journal)  # behind what it offers already: kept
    assert broker.recovered is held
    sidecar = SiteMember("site-d", bus, role=Role.SIDECAR, observer=NullObserver())
    sidecar.offer_held(held)
    assert sidecar.recovered is None  # only brokers report to a recovery
