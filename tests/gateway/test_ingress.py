"""gateway/ingress: admission, apply-then-ack and resync, on in-memory streams
with a virtual clock (no sockets, no bus)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from cluster import state as st
from cluster.bus import BusConfig
from gateway import fencing
from gateway import resync as rs
from gateway.ingress import Ingress
from gateway.linkconfig import LinkSettings
from gateway.roles import SidecarRole
from protocol import cluster as pc
from protocol import link
from protocol.link.frames import ErrorFrame, decode_frame_untrusted, encode_frame
from protocol.modes import Mode
from tests.support.calls import count_calls
from tests.support.linkpeer import LinkEnd, MemberStandIn, replicated, sidecar_config

INCARNATION = 5


def make_ingress(
    tmp_path: Path, member: MemberStandIn, role: SidecarRole = SidecarRole.INGRESS
) -> Ingress:
    config = sidecar_config(tmp_path, primary=False, site="site-d", peer="site-p")
    return Ingress(config, member, role=lambda: role, active=lambda: None)  # type: ignore[arg-type]


def egress_end(stream: trio.abc.Stream, *, epoch: int = 1) -> LinkEnd:
    sender = link.LinkSender(
        link.SenderConfig(
            origin_cluster="site-p", target_cluster="site-d", incarnation=INCARNATION, epoch=epoch
        )
    )
    return LinkEnd(sender, stream)


@asynccontextmanager
async def connected(ingress: Ingress, *, epoch: int = 1) -> AsyncIterator[LinkEnd]:
    """An egress end connected to ``ingress`` (nothing sent yet)."""
    ours, theirs = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ingress.handle, theirs)
        yield egress_end(ours, epoch=epoch)
        nursery.cancel_scope.cancel()


async def hello(end: LinkEnd) -> link.Welcome:
    await end.stream.send_all(end.machine.start(trio.current_time(), resume_point=0))
    return await end.next_of(link.Welcome)


async def test_welcome_resumes_after_what_d_applied(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    member = MemberStandIn("site-d")
    member.apply(pc.Replicated("site-p", INCARNATION, 41, 1, 0, (), ()))
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        welcome = await hello(end)
        assert welcome.resume_from == 41
        assert ingress.status.state == "up"


async def test_acks_only_what_d_applied(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    member = MemberStandIn("site-d")
    member.gate = trio.Event()
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        await hello(end)
        end.machine.send_event(link.LinkEvent(1, 1_000, replicated(1)))
        end.machine.send_event(link.LinkEvent(2, 2_000, replicated(2)))
        # D's bus holds the batch: no ack may come, however long we wait.
        with trio.move_on_after(10):
            await end.next_of(link.Acked)
        assert not any(isinstance(e, link.Acked) for e in end.events)
        assert "site-p" not in member.state.origins
        member.gate.set()
        acked = await end.next_of(link.Acked)
        assert acked.seq == 2
        assert member.state.origins["site-p"].applied[INCARNATION] == 2
        assert ingress.ingested == 2


async def test_the_links_statistics_are_read_when_asked_not_at_every_turn(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reading loop turns once per wake-up; building the receiver's
    statistics there cost 2 µs each, for a ``/status`` read once a few seconds."""
    built = count_calls(monkeypatch, link.LinkReceiver, "statistics")
    member = MemberStandIn("site-d")
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        await hello(end)
        for seq in range(1, 21):
            end.machine.send_event(link.LinkEvent(seq, seq * 1_000, replicated(seq)))
            await end.pump_for(0.1)
        assert ingress.ingested == 20
        assert built == []
        assert ingress.link_statistics().batches_received_total == 20  # as it is now
        assert len(built) == 1


async def test_an_ack_wakes_the_reading_loop_only_when_it_changes_what_is_due(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events applied one by one, 0.5 ms apart: the first ack starts the ack
    timer (the loop must turn to arm it), the next ones only add to the ack
    the timer sends.  Each of them used to cancel the loop's wait for bytes,
    a turn of the loop and a new receive per applied batch."""
    from gateway import ingress as ingress_module

    turns = count_calls(monkeypatch, ingress_module._Connection, "_receive")
    member = MemberStandIn("site-d")
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        await hello(end)
        await end.pump_for(1)
        turns.clear()
        for seq in range(1, 31):
            end.machine.send_event(link.LinkEvent(seq, seq * 1_000, replicated(seq)))
            await end.stream.send_all(end.machine.data_to_send(trio.current_time()))
            await trio.sleep(0.0005)
        acked = await end.next_of(link.Acked)
        assert (acked.seq, ingress.ingested) == (30, 30)  # one ack, when its timer ran out
        # A turn per batch of bytes, one to arm the timer, one when it runs
        # out, and one when trio's scheduling order puts an ack between the
        # two (before: 41 to 49).
        assert len(turns) <= 30 + 3


def durable_on_disk(member: MemberStandIn, ingress: Ingress, cseq: int) -> None:
    """A D broker's ``Durable`` report applied, and the sidecar's hook for it."""
    member.apply(pc.Durable(2, cseq))
    ingress.durable.advanced()


def acks(end: LinkEnd) -> list[int]:
    return [e.seq for e in end.events if isinstance(e, link.Acked)]


async def test_with_journals_an_ack_waits_until_a_d_broker_has_the_event_on_disk(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """P drops what D acks from its spool for good: with D's brokers keeping
    journals, D acks an applied event only once its D cseq is durable, so a
    power loss of the whole DR site loses nothing P will not resend."""
    member = MemberStandIn("site-d", bus_config=BusConfig("memory", "site-d", 1, expect_brokers=3))
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        await hello(end)
        applied_at = {}
        for seq in (1, 2):
            end.machine.send_event(link.LinkEvent(seq, 1_000 * seq, replicated(seq)))
            await end.pump_for(10)
            assert st.applied(member.state, "site-p", INCARNATION) == seq
            applied_at[seq] = member.state.cseq
        assert acks(end) == []  # applied, but only in D's memory
        durable_on_disk(member, ingress, applied_at[1] - 1)  # a commit just before event 1
        await end.pump_for(10)
        assert acks(end) == []
        durable_on_disk(member, ingress, applied_at[1])
        assert (await end.next_of(link.Acked)).seq == 1
        await end.pump_for(10)
        assert max(acks(end)) == 1  # event 2 is not on disk yet
        durable_on_disk(member, ingress, applied_at[2])
        assert (await end.next_of(link.Acked)).seq == 2


async def test_with_journals_the_welcome_waits_until_what_d_applied_is_on_a_d_broker_s_disk(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """P drops its spool up to the WELCOME's resume point as it does on an
    ack.  A D standby that takes the link over while D's brokers are stopped
    (a slow disk) held events no journal had: its WELCOME made P drop them,
    and the power cut that followed lost them (a fresh-clone run resynced D).
    The WELCOME waits for D's disk like an ack, and refuses for now if it
    does not come."""
    journaled = BusConfig("memory", "site-d", 1, expect_brokers=3)
    member = MemberStandIn("site-d", bus_config=journaled)
    member.apply(pc.Replicated("site-p", INCARNATION, 41, 1, 0, (), ()))
    applied_at = member.state.cseq
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        await end.stream.send_all(end.machine.start(trio.current_time(), resume_point=0))
        await end.pump_for(1)
        assert not any(isinstance(e, link.Welcome) for e in end.events)
        durable_on_disk(member, ingress, applied_at)
        welcome = await end.next_of(link.Welcome)
        assert welcome.resume_from == 41

    member.apply(pc.Replicated("site-p", INCARNATION, 42, 1, 0, (), ()))
    async with connected(ingress) as end:  # D's brokers never report it
        await end.stream.send_all(end.machine.start(trio.current_time(), resume_point=0))
        error = await end.next_of(link.PeerError)
        assert error.retriable
        assert error.code == link.LinkErrorCode.NOT_DURABLE
        assert "journal" in error.text and "site-p" in error.text
        assert not any(isinstance(e, link.Welcome) for e in end.events)


async def test_standby_refuses_and_names_itself(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    ingress = make_ingress(tmp_path, MemberStandIn("site-d"), SidecarRole.INGRESS_STANDBY)
    async with connected(ingress) as end:
        await end.stream.send_all(end.machine.start(trio.current_time()))
        error = await end.next_of(link.PeerError)
        assert error.retriable
        assert error.code == link.LinkErrorCode.NOT_ACTIVE
        assert "ingress-standby" in error.text


async def test_a_promoted_site_fences_its_old_primary(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    member = MemberStandIn("site-d")
    member.apply(pc.Replicated("site-p", INCARNATION, 3, 1, 0, (), ()))
    member.apply(pc.Promote("site-p", 2, 1_700_000_000_000_000))
    ingress = make_ingress(tmp_path, member)
    for epoch in (1, 2):  # below the promotion's epoch, and the promotion's own
        async with connected(ingress, epoch=epoch) as end:
            await end.stream.send_all(end.machine.start(trio.current_time()))
            error = await end.next_of(link.PeerError)
            assert error.code == link.LinkErrorCode.PARTITIONED
            assert not error.retriable
            assert "was promoted" in error.text
        assert "site-p" in ingress.status.last_error


async def test_a_promotion_closes_an_open_link(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    member = MemberStandIn("site-d")
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        await hello(end)
        end.machine.send_event(link.LinkEvent(1, 1_000, replicated(1)))
        assert (await end.next_of(link.Acked)).seq == 1
        member.apply(pc.Promote("site-p", 2, 1_700_000_000_000_000))
        end.machine.send_event(link.LinkEvent(2, 2_000, replicated(2)))
        error = await end.next_of(link.PeerError)
        assert error.code == link.LinkErrorCode.PARTITIONED
    assert member.state.origins["site-p"].applied[INCARNATION] == 1


async def test_resync_is_staged_in_pieces_and_installed_at_its_cut_then_acked(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    p = MemberStandIn("site-p")
    p.apply(pc.QueueDeclare("q-full"), pc.QueueDeclare("q-local"))
    for i in range(300):
        p.apply(pc.Publish("", "q-full", b"x" * 100, f"m-{i}"))
    rules = sidecar_config(tmp_path, primary=True, site="site-p", peer="site-d").rules
    plan = rs.plan_snapshot(p.state, rules)
    stream = rs.SnapshotStream(plan, rules, origin="site-p", epoch=1, time_us=5, chunk_bytes=4096)
    chunks = list(stream.chunks())
    assert len(chunks) > 3
    member = MemberStandIn("site-d")
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        await hello(end)
        end.machine.begin_resync(plan.cut)  # streamed: the totals come at the end
        for chunk in chunks:
            end.machine.send_chunk(chunk)
        acked = await end.next_of(link.Acked)
        while acked.resync_chunks < len(chunks):
            acked = await end.next_of(link.Acked)
        # Every piece is staged at D, and no client can see any of it yet.
        assert member.state.staged["site-p"].pieces == len(chunks)
        assert "q-full" not in member.state.queues
        end.machine.end_resync()
        while acked.seq < plan.cut:
            acked = await end.next_of(link.Acked)
        assert acked.seq == plan.cut
        assert [type(c) for c in member.applied[-len(chunks) - 1 :]] == [pc.ResyncStage] * len(
            chunks
        ) + [pc.ResyncCommit]
        assert member.state.origins["site-p"].applied[INCARNATION] == plan.cut
        assert member.state.origins["site-p"].last_time_us == 5
        assert set(member.state.queues) == {"q-full"}  # q-local is not replicated
        assert st.queue_digest(member.state, "q-full") == st.queue_digest(p.state, "q-full")
        assert not member.state.staged
        assert ingress.status.resync.total == 1
        assert not ingress.status.resync.active


async def test_a_hole_in_the_stream_is_refused_not_applied_past(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    member = MemberStandIn("site-d")
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        await hello(end)
        end.machine.send_event(link.LinkEvent(1, 1_000, replicated(1)))
        # The forwarded event 2 never left P: 3 says its previous one is 2.
        end.machine.send_event(link.LinkEvent(3, 3_000, replicated(3), prev_seq=2))
        error = await end.next_of(link.PeerError)
        assert error.code == link.LinkErrorCode.GAP
        assert "resync" in error.text
    assert member.state.origins["site-p"].applied[INCARNATION] <= 1
    assert ingress.link_statistics().gaps_total == 1


def _frame(*commands: pc.Command) -> bytes:
    return pc.encode_frame(list(commands))


def _at(seq: int, *inner: pc.Command) -> pc.Replicated:
    return pc.Replicated("site-p", INCARNATION, seq, 1, 0, (Mode.FULL,) * len(inner), inner)


FORGED = {
    # What a link client written from docs/protocol.md alone tried on D.
    "a raw queue delete": _frame(pc.QueueDelete("local")),
    "a raw promote": _frame(pc.Promote("site-p", 9, 0)),
    "a raw incarnation switch": _frame(pc.AcceptIncarnation("site-p", 77)),
    "a rules switch": _frame(pc.RulesSwitch(b"{}")),
    "a poisoned watermark": _frame(pc.AckWatermark("site-d", 1, 2**62, 0)),
    "another origin": replicated(2, origin="site-x"),
    "a higher epoch": replicated(2, epoch=3),
    "another incarnation": replicated(2, incarnation=6),
    "a position not its event's": _frame(_at(2**62, pc.QueueDeclare("q"))),
    "two commands in one event": _frame(_at(2, pc.QueueDeclare("q")), _at(2, pc.Purge("q"))),
}


async def test_a_peer_may_send_only_its_own_stream_at_its_own_positions(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    member = MemberStandIn("site-d")
    member.apply(pc.QueueDeclare("local"), pc.Publish("", "local", b"kept", "m-1"))
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        await hello(end)
        end.machine.send_event(link.LinkEvent(1, 1_000, replicated(1)))
        assert (await end.next_of(link.Acked)).seq == 1
    before = st.digest(member.state)
    for what, payload in FORGED.items():
        async with connected(ingress) as end:
            assert (await hello(end)).resume_from == 1
            end.machine.send_event(link.LinkEvent(2, 2_000, payload, prev_seq=1))
            error = await end.next_of(link.PeerError)
            assert error.code == link.LinkErrorCode.FORBIDDEN, what
            assert "event 2" in error.text, what
        assert st.digest(member.state) == before, f"{what} changed D's state"
    assert member.state.queues["local"].depth == 1
    assert not member.state.origins["site-p"].promoted
    assert ingress.link_statistics().refused_total == len(FORGED)
    # The genuine stream goes on.
    async with connected(ingress) as end:
        assert (await hello(end)).resume_from == 1
        end.machine.send_event(link.LinkEvent(2, 2_000, replicated(2), prev_seq=1))
        assert (await end.next_of(link.Acked)).seq == 2


async def test_no_epoch_undoes_a_promotion(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    member = MemberStandIn("site-d")
    member.apply(pc.Replicated("site-p", INCARNATION, 41, 1, 0, (), ()))
    member.apply(pc.Promote("site-p", 2, 1_700_000_000_000_000))
    ingress = make_ingress(tmp_path, member)
    for epoch in (1, 2, 3, 2**31):  # the old one, the promotion's, and above
        async with connected(ingress, epoch=epoch) as end:
            await end.stream.send_all(end.machine.start(trio.current_time(), resume_point=0))
            error = await end.next_of(link.PeerError)
            assert error.code == link.LinkErrorCode.PARTITIONED, epoch
            assert "was promoted" in error.text
    origin = member.state.origins["site-p"]
    assert (origin.promoted, origin.epoch) == (True, 2)
    # Only the operator lets the primary in again, at the epoch D names.
    member.apply(pc.AcceptPrimary("site-p", 3))
    async with connected(ingress, epoch=3) as end:
        assert (await hello(end)).resume_from == 0  # a resync will replace D's replicas


async def test_events_go_to_d_bus_as_the_bytes_they_came_in(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    relayed: list[bytes] = []

    class Recording(MemberStandIn):
        async def submit_frames_and_wait(self, frames: list[bytes]) -> int:
            relayed.extend(frames)
            return await super().submit_frames_and_wait(frames)

    ingress = make_ingress(tmp_path, Recording("site-d"))
    payloads = [replicated(seq) for seq in (1, 2, 3)]
    async with connected(ingress) as end:
        await hello(end)
        for seq, payload in enumerate(payloads, 1):
            end.machine.send_event(link.LinkEvent(seq, 1_000 * seq, payload, prev_seq=seq - 1))
        acked = await end.next_of(link.Acked)
        while acked.seq < 3:
            acked = await end.next_of(link.Acked)
    assert relayed == payloads  # neither decoded nor encoded again on the way
    assert ingress.ingested == 3


@pytest.mark.parametrize(
    "inner",
    [
        [pc.QueueDeclare("q"), pc.Purge("q")],  # two commands for one mode
        [_at(1, pc.QueueDeclare("q"))],  # a Replicated inside a Replicated
    ],
)
async def test_an_event_whose_inner_frame_does_not_match_its_modes_is_malformed(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, inner: list[pc.Command]
) -> None:
    member = MemberStandIn("site-d")
    ingress = make_ingress(tmp_path, member)
    async with connected(ingress) as end:
        await hello(end)
        end.machine.send_event(link.LinkEvent(1, 1_000, _forged_replicated(1, inner)))
        error = await end.next_of(link.PeerError)
    assert error.code == link.LinkErrorCode.MALFORMED
    assert "event 1" in error.text
    assert "site-p" not in member.state.origins


def _forged_replicated(seq: int, inner: list[pc.Command]) -> bytes:
    """A Replicated at ``seq`` with one mode whose tail holds ``inner``
    (which no encoder of ours would write)."""
    kind, key, rest = pc.encode_command(_at(seq, pc.QueueDeclare("x")))
    (meta_len,) = pc.META_LEN.unpack_from(rest)
    body = rest[: pc.META_LEN.size + meta_len] + b"".join(
        # the inner frame, by hand: header, index, data
        [pc.FRAME_HEADER.pack(pc.VERSION, 0, len(inner))]
        + [pc.INDEX_ENTRY.pack(k, 0, len(n), len(r)) for k, n, r in map(pc.encode_command, inner)]
        + [n + r for _k, n, r in map(pc.encode_command, inner)]
    )
    header = pc.FRAME_HEADER.pack(pc.VERSION, 0, 1) + pc.INDEX_ENTRY.pack(
        kind, 0, len(key), len(body)
    )
    return header + key + body


async def test_the_config_sets_the_acks_batching_and_caps_the_window(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    member = MemberStandIn("site-d")
    config = sidecar_config(tmp_path, primary=False, site="site-d", peer="site-p")
    settings = LinkSettings(ack_events=2, ack_ms=5_000, window_bytes=1 << 20)
    ingress = Ingress(
        dataclasses.replace(config, link=settings),
        member,  # type: ignore[arg-type]
        role=lambda: SidecarRole.INGRESS,
        active=lambda: None,
    )
    async with connected(ingress) as end:
        welcome = await hello(end)
        assert welcome.window_bytes == 1 << 20  # P proposed the default 8 MiB
        start = trio.current_time()
        end.machine.send_event(link.LinkEvent(1, 1_000, replicated(1)))
        end.machine.send_event(link.LinkEvent(2, 2_000, replicated(2)))
        assert (await end.next_of(link.Acked)).seq == 2  # two events: at once
        assert trio.current_time() - start < 1
        end.machine.send_event(link.LinkEvent(3, 3_000, replicated(3)))
        assert (await end.next_of(link.Acked)).seq == 3  # one: after ack_ms
        assert trio.current_time() - start >= 5


async def test_an_ingress_that_stops_being_active_hands_the_link_over(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A D sidecar restarted on a lower node becomes the active ingress while
    P's link is still on the one that took over: that one ends the link
    (retriable, naming the active one) within seconds, so the egress finds
    the active ingress, and it no longer reports the link up."""
    member = MemberStandIn("site-d")
    role = SidecarRole.INGRESS
    config = sidecar_config(tmp_path, primary=False, site="site-d", peer="site-p", node=2)
    ingress = Ingress(config, member, role=lambda: role, active=lambda: None)  # type: ignore[arg-type]
    async with connected(ingress) as end:
        await hello(end)
        end.machine.send_event(link.LinkEvent(1, 1_000, replicated(1)))
        assert (await end.next_of(link.Acked)).seq == 1
        role = SidecarRole.INGRESS_STANDBY
        start = trio.current_time()
        error = await end.next_of(link.PeerError)
        assert trio.current_time() - start <= 2.0
        assert error.code == link.LinkErrorCode.NOT_ACTIVE and error.retriable
        assert "ingress-standby" in error.text
        await trio.testing.wait_all_tasks_blocked()
        assert ingress.status.state == "down"
    assert ingress.links_up == 0


async def test_a_second_primary_is_a_split_brain_both_park(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """D was promoted over P and P's egress connects (whatever its epoch):
    refused for good as PARTITIONED, nothing applied, D reports partitioned
    with the commands that resolve it; an older egress gets STALE_EPOCH."""
    member = MemberStandIn("site-d")
    member.apply(pc.Replicated("site-p", INCARNATION, 3, 1, 0, (), ()))
    member.apply(pc.Promote("site-p", 2, 1_700_000_000_000_000))
    ingress = make_ingress(tmp_path, member)
    assert not ingress.link_statistics().partitioned
    applied_before = member.state.cseq
    async with connected(ingress, epoch=2) as end:
        await end.stream.send_all(end.machine.start(trio.current_time()))
        error = await end.next_of(link.PeerError)
        await end.stream.aclose()  # the refused egress goes: the reason stays
        await trio.testing.wait_all_tasks_blocked()
    assert error.code == link.LinkErrorCode.PARTITIONED and not error.retriable
    assert "split brain" in error.text
    assert "drgate failback --config" in error.text
    assert ingress.link_statistics().partitioned
    assert "split brain" in ingress.status.last_error
    assert member.state.cseq == applied_before  # nothing merged

    old = link.Hello("site-p", "site-d", INCARNATION, 1, 0, 1 << 20, minor=1)
    receiver = link.LinkReceiver(link.ReceiverConfig(cluster_id="site-d"), now=0.0)
    receiver.receive_data(encode_frame(old))
    hello = receiver.next_event()
    assert isinstance(hello, link.Hello)
    _answer, accepted = ingress.answer_hello(receiver, hello)
    assert not accepted
    refusal = decode_frame_untrusted(_answer)
    assert isinstance(refusal, ErrorFrame)
    assert refusal.code == link.LinkErrorCode.STALE_EPOCH


async def test_the_split_brain_flag_clears_once_the_other_primary_stops(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    member = MemberStandIn("site-d")
    member.apply(pc.Promote("site-p", 2, 1_700_000_000_000_000))
    ingress = make_ingress(tmp_path, member)
    now = [1000.0]
    monkeypatch.setattr(fencing.time, "monotonic", lambda: now[0])
    ingress.partition.refused("site-p")
    assert ingress.link_statistics().partitioned
    now[0] += fencing.PARTITION_HOLD_S - 1
    assert ingress.link_statistics().partitioned
    now[0] += 2  # no HELLO from the other primary for PARTITION_HOLD_S
    assert not ingress.link_statistics().partitioned
