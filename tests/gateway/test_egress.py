"""gateway/egress: resume, window, reconnect, resync and refusals, on in-memory
streams with a virtual clock; the test plays D with a sans-IO LinkReceiver."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from cluster.addresses import Address
from cluster.bus import BusConfig
from gateway.egress import Egress
from gateway.roles import RoleSignal, SidecarRole
from gateway.spool import Spool
from gateway.tap import Tap
from protocol import cluster as pc
from protocol import link
from tests.support.calls import count_calls
from tests.support.linkpeer import LinkEnd, MemberStandIn, sidecar_config

PAYLOAD = b"x" * 100


class Site:
    """P's pieces around one Egress; ``links`` hands out D's end of every
    connection the egress opens, with the address it dialled."""

    def __init__(self, tmp_path: Path, *, events: int) -> None:
        self.config = sidecar_config(tmp_path, primary=True, site="site-p", peer="site-d")
        self.member = MemberStandIn("site-p")
        self.spool = Spool.open(
            self.config.spool_dir, max_bytes=1 << 20, segment_bytes=1 << 16, fsync="never"
        )
        self.spool.append_many((seq, seq * 1_000, PAYLOAD, seq - 1) for seq in range(1, events + 1))
        self.role = SidecarRole.EGRESS
        self.roles = RoleSignal()
        self._send, self.links = trio.open_memory_channel[tuple[str, trio.abc.Stream]](10)
        self.egress = Egress(
            self.config,
            self.member,  # type: ignore[arg-type]
            Tap(self.config.rules, origin_cluster="site-p"),
            spool=lambda: self.spool,
            role=lambda: self.role,
            roles=self.roles,
            connect=self.connect,
        )

    async def connect(self, address: Address) -> trio.abc.Stream:
        ours, theirs = trio.testing.memory_stream_pair()
        await self._send.send((str(address), theirs))
        return ours

    async def next_link(self) -> tuple[str, LinkEnd]:
        address, stream = await self.links.receive()
        receiver = link.LinkReceiver(link.ReceiverConfig(cluster_id="site-d"), now=0.0)
        return address, LinkEnd(receiver, stream)


@asynccontextmanager
async def running(site: Site) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(site.egress.serve)
        yield
        nursery.cancel_scope.cancel()


async def accept(d: LinkEnd, resume_from: int, *, window: int | None = None) -> link.Hello:
    hello = await d.next_of(link.Hello)
    answer = d.machine.accept(resume_from, window or hello.window_bytes, trio.current_time())
    await d.stream.send_all(answer)
    return hello


async def receive_through(d: LinkEnd, last: int) -> list[int]:
    """The seqs D receives until ``last`` (acking none)."""
    seqs: list[int] = []
    while not seqs or seqs[-1] < last:
        got = await d.next_of(link.EventsReceived)
        seqs.extend(e.seq for e in got.events)
    return seqs


async def test_streams_the_spool_after_ds_resume_point(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    site = Site(tmp_path, events=10)
    async with running(site):
        address, d = await site.next_link()
        assert address == "d1:1"
        hello = await accept(d, 4)
        assert (hello.origin_cluster, hello.target_cluster) == ("site-p", "site-d")
        assert await receive_through(d, 10) == list(range(5, 11))
        assert site.egress.link_statistics().lag_events == 6  # D applied up to 4
        d.machine.ack(10)
        await d.pump_for(2)
        assert site.egress.acked_seq == 10
        assert (
            site.egress.link_statistics().lag_events,
            site.egress.link_statistics().lag_seconds,
        ) == (0, 0.0)
        assert site.egress.status.state == "up"
    assert site.spool.floor == 10  # D's ack trimmed the spool
    marks = [c for c in site.member.posted if isinstance(c, pc.AckWatermark)]
    assert [m.cseq for m in marks] == [4, 10]  # the standbys are told


async def test_the_links_statistics_are_read_when_asked_not_at_every_turn(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop turns once per wake-up; building the sender's statistics
    there cost 2 µs each, for a ``/status`` read once a few seconds."""
    built = count_calls(monkeypatch, link.LinkSender, "statistics")
    site = Site(tmp_path, events=10)
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 4)
        assert await receive_through(d, 10) == list(range(5, 11))
        for seq in range(11, 31):
            site.spool.append(seq, seq * 1_000, PAYLOAD, seq - 1)
            site.egress.wake()
            await receive_through(d, seq)
        assert built == []
        assert site.egress.link_statistics().events_sent_total == 26  # as it is now
        assert len(built) == 1


async def test_each_event_carries_its_spooled_prev_seq(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    site = Site(tmp_path, events=0)
    site.spool.append_many([(3, 1, PAYLOAD, 0), (7, 2, PAYLOAD, 3), (9, 3, PAYLOAD, 7)])
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 3)
        got = await d.next_of(link.EventsReceived)
        assert [(e.seq, e.prev_seq) for e in got.events] == [(7, 3), (9, 7)]


async def test_an_event_above_the_durable_watermark_waits_for_it_without_spinning(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # tests/chaos: the spool's last event was above the site's durable
    # watermark and the next one too; the loop took "more to send" for
    # work, never yielded, and the watermark (moved by the applier) never
    # moved: the first egress of a durable site streamed nothing.
    site = Site(tmp_path, events=0)
    site.member.bus_config = BusConfig("memory", "site", 1, expect_brokers=3)
    site.spool.append_many([(3, 1, PAYLOAD, 0), (7, 2, PAYLOAD, 3), (9, 3, PAYLOAD, 7)])
    site.member.state.durable_cseq = 5
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 3)
        await d.pump_for(5)  # virtual time: it passes only if the egress yields
        assert d.machine.statistics().events == 0
        site.member.state.durable_cseq = 9
        site.egress.wake()  # as the Durable command's hook does
        assert await receive_through(d, 9) == [7, 9]


async def test_a_full_window_waits_for_acks(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    site = Site(tmp_path, events=50)
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 0 + 1, window=1_000)  # about eight events of 100 bytes
        first = await receive_through(d, 2)
        with trio.move_on_after(10):  # no ack: the egress must stop
            first += await receive_through(d, 50)
        assert 2 <= len(first) < 50
        received = list(first)
        while received[-1] < 50:
            d.machine.ack(received[-1])
            received += await receive_through(d, min(50, received[-1] + 1))
        assert received == list(range(2, 51))


async def test_reconnects_and_resumes_where_d_stopped(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    site = Site(tmp_path, events=6)
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 0 + 1)
        assert await receive_through(d, 6) == [2, 3, 4, 5, 6]
        d.machine.ack(3)
        await d.pump_for(2)
        await d.stream.aclose()  # the WAN cut after D applied up to 3
        address, d = await site.next_link()
        assert address == "d2:1"  # the next of D's sidecars
        await accept(d, 3)
        assert await receive_through(d, 6) == [4, 5, 6]
        assert site.egress.status.reconnects == 1


async def test_a_d_that_applied_nothing_gets_a_snapshot_first(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    site = Site(tmp_path, events=0)
    site.member.apply(pc.QueueDeclare("q-full"))
    cut = site.member.state.cseq
    site.spool.append_many([(cut + 1, 1, PAYLOAD, cut)])
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 0)
        begin = await d.next_of(link.ResyncBegin)
        assert begin.cut_seq == cut
        await d.next_of(link.ResyncEnd)
        assert site.egress.status.resync.active
        assert await receive_through(d, cut + 1) == [cut + 1]  # then the stream after the cut


async def test_only_the_egress_connects(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    site = Site(tmp_path, events=1)
    site.role = SidecarRole.STANDBY
    async with running(site):
        with trio.move_on_after(30):
            await site.next_link()
            raise AssertionError("a standby connected to D")
        assert site.egress.status.state == "down"
        site.role = SidecarRole.EGRESS
        site.roles.changed()
        await site.next_link()


async def test_a_gap_found_by_d_is_healed_by_a_resync(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    site = Site(tmp_path, events=6)
    site.member.apply(*(pc.QueueDeclare(f"local-{n}") for n in range(6)))  # P's cseq: 7
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 2)
        await d.next_of(link.EventsReceived)
        await d.stream.send_all(
            d.machine.send_error(int(link.LinkErrorCode.GAP), "gap (test)", retriable=True)
        )
        # D holds 2, which the spool still reaches: only the gap makes P resync.
        assert not site.spool.needs_resync(2)
        _, d = await site.next_link()
        await accept(d, 2)
        begin = await d.next_of(link.ResyncBegin)
        assert begin.cut_seq == site.member.state.cseq
        assert site.egress.gaps == 1
        assert site.egress.link_statistics().gaps_total == 1


async def test_a_resync_is_made_as_the_window_takes_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """P holds one chunk beyond the window, however big the snapshot: a D
    that acks nothing gets one window's worth, and the rest is not encoded."""
    site = Site(tmp_path, events=0)
    site.member.apply(pc.QueueDeclare("q-full"))
    for i in range(600):
        site.member.apply(pc.Publish("", "q-full", bytes(10_000), f"m-{i}"))
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 0, window=1_500_000)  # one chunk of about 1 MiB in flight
        begin = await d.next_of(link.ResyncBegin)
        assert (begin.total_chunks, begin.total_bytes) == (0, 0)  # streamed
        await d.next_of(link.ResyncChunk)
        await d.pump_for(10)  # no ack: the egress must stop making chunks
        resync = site.egress.status.resync
        assert resync.chunks <= 2, f"{resync.chunks} chunks made for one in flight"
        assert resync.messages == 600 and resync.messages_done < 300
        chunks = 1
        while True:
            d.machine.ack_chunk()
            ev = await d.next_of((link.ResyncChunk, link.ResyncEnd))
            if isinstance(ev, link.ResyncEnd):
                break
            chunks += 1
        assert ev.total_chunks == chunks >= 6
        assert ev.total_bytes > 6_000_000
        assert resync.messages_done == 600 and resync.progress_ratio == 1.0


async def test_refused_as_stale_the_egress_turns_the_zombie_guard_on(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    site = Site(tmp_path, events=0)
    site.member.apply(pc.QueueDeclare("q-full"), pc.QueueDeclare("q-enq"))
    site.egress.tap.resync_rules(site.member.state)
    async with running(site):
        _, d = await site.next_link()
        await d.next_of(link.Hello)
        text = "site-d was promoted at 2026-11-24 10:00:00 UTC (epoch 2)"
        await d.stream.send_all(
            d.machine.refuse(int(link.LinkErrorCode.STALE_EPOCH), text, retriable=False)
        )
        await site.next_link()  # it tries again, later
    (superseded,) = [c for c in site.member.posted if isinstance(c, pc.Superseded)]
    assert superseded.by_cluster == "site-d"
    # zombie_guard: full, the default, closes q-full; q-enq stays open to
    # publishes but, after a failback, waits for D like q-full.
    assert superseded.guarded == {"q-full": None, "q-enq": pc.FAILBACK_ONLY}
    assert "promoted" in site.egress.status.last_error


async def test_a_refusal_for_good_outlives_standbys_answers(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """docs/observability.md: refused while D refuses for good, through the
    standbys' "not active" answers and the retries, until a WELCOME."""
    site = Site(tmp_path, events=1)
    async with running(site):
        _, d = await site.next_link()
        await d.next_of(link.Hello)
        await d.stream.send_all(
            d.machine.refuse(int(link.LinkErrorCode.STALE_EPOCH), "promoted", retriable=False)
        )
        _, d = await site.next_link()
        assert site.egress.status.state == "refused"
        assert site.egress.link_statistics().state == "refused"
        await d.next_of(link.Hello)
        await d.stream.send_all(
            d.machine.refuse(int(link.LinkErrorCode.NOT_ACTIVE), "standby", retriable=True)
        )
        _, d = await site.next_link()  # tried again: the refusals were handled
        assert site.egress.status.state == "refused"
        assert "promoted" in site.egress.status.last_error
        await accept(d, 1)
        await d.pump_for(1)
        assert site.egress.status.state == "up"


async def test_the_last_ack_of_a_burst_reaches_the_standbys(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Watermarks go out at most once a second, but the last one is never
    held back for good: at quiescence the standbys trim to D's last ack."""
    site = Site(tmp_path, events=6)
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 0 + 1)
        await receive_through(d, 6)
        await d.pump_for(1)
        d.machine.ack(3)
        await d.pump_for(0.1)
        d.machine.ack(6)  # within the second after the watermark of 3
        await d.pump_for(5)
    marks = [c.cseq for c in site.member.posted if isinstance(c, pc.AckWatermark)]
    assert marks == [1, 3, 6]


async def test_a_converged_egress_reports_acked_seq_equal_to_last_seq(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """D applied everything the spool holds before this egress took over:
    the WELCOME says so, and no ack follows (there is nothing to send)."""
    site = Site(tmp_path, events=6)
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 6)
        await d.pump_for(3)
        stats = site.egress.link_statistics()
        assert (stats.acked_seq, stats.last_seq, stats.lag_events) == (6, 6, 0)


async def test_a_resync_cut_above_the_spools_last_event_converges(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A cut is a cseq, not every command makes an event: once D acked the
    cut, last_seq is the cut too."""
    site = Site(tmp_path, events=0)
    site.member.apply(pc.QueueDeclare("q-full"), pc.QueueDeclare("local"))
    cut = site.member.state.cseq
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 0)
        await d.next_of(link.ResyncEnd)
        d.machine.ack(cut)
        await d.pump_for(3)
        stats = site.egress.link_statistics()
        assert (stats.acked_seq, stats.last_seq, stats.lag_events) == (cut, cut, 0)


async def test_a_standby_reports_the_announced_ack_and_no_lag(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    site = Site(tmp_path, events=6)
    site.role = SidecarRole.STANDBY
    site.spool.trim(6)  # the active egress's watermark, applied by the sidecar
    stats = site.egress.link_statistics()
    assert (stats.acked_seq, stats.last_seq, stats.lag_events) == (6, 6, 0)


async def test_refused_as_partitioned_the_egress_parks_and_says_so(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Split brain: D is a primary too.  The egress reports partitioned
    (through standbys' answers) with D's text, turns the zombie guard on,
    and a WELCOME (the operator resolved it) clears it."""
    site = Site(tmp_path, events=1)
    async with running(site):
        assert not site.egress.link_statistics().partitioned
        _, d = await site.next_link()
        await d.next_of(link.Hello)
        text = "split brain: site-d and site-p are both primaries; run 'drgate failback'"
        code = int(link.LinkErrorCode.PARTITIONED)
        await d.stream.send_all(d.machine.refuse(code, text, retriable=False))
        _, d = await site.next_link()
        stats = site.egress.link_statistics()
        assert stats.partitioned and stats.state == "refused"
        assert "drgate failback" in site.egress.status.last_error
        await d.next_of(link.Hello)
        await d.stream.send_all(
            d.machine.refuse(int(link.LinkErrorCode.NOT_ACTIVE), "standby", retriable=True)
        )
        _, d = await site.next_link()
        assert site.egress.link_statistics().partitioned
        await accept(d, 1)
        await d.pump_for(1)
        assert not site.egress.link_statistics().partitioned
    assert any(isinstance(c, pc.Superseded) for c in site.member.posted)


async def test_the_egress_pings_carry_ps_clock_and_last_seq(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    site = Site(tmp_path, events=6)
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 6)
        before = time.time() * 1e6
        beat = await d.next_of(link.Heartbeat, within=10)
    assert beat.last_seq == 6
    assert before - 1e6 <= beat.time_us <= time.time() * 1e6  # P's wall clock


class _StampOrder:
    """A capture that notes when the egress stamps its forwarded events,
    and a stream that notes how many events the link had handed out at each
    send: an event must be stamped before its bytes leave."""

    def __init__(self) -> None:
        self.sender: object = None
        self.stamped = 0
        self.late: list[tuple[int, int]] = []  # (handed out, stamped) at a send

    def forwarded(self, sender: object, seq: int, payload: bytes) -> None:
        self.sender = sender

    def forwarded_sent(self, sender: object, stats: link.SenderStatistics) -> None:
        self.stamped = stats.events

    def sent(self) -> None:
        if self.sender is not None:
            handed_out = self.sender.statistics().events  # type: ignore[attr-defined]
            if handed_out > self.stamped:
                self.late.append((handed_out, self.stamped))


class _NotingStream(trio.abc.Stream):
    def __init__(self, inner: trio.abc.Stream, order: _StampOrder) -> None:
        self.inner, self.order = inner, order

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.order.sent()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_forwarded_event_is_stamped_before_its_bytes_leave(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # Stamped after the send, an event could be applied at D before P's
    # capture said it left: the analysis's lag came out negative on loopback.
    order = _StampOrder()

    class Noting(Site):
        async def connect(self, address: Address) -> trio.abc.Stream:
            return _NotingStream(await super().connect(address), order)

    site = Noting(tmp_path, events=10)
    site.egress.capture = order  # type: ignore[assignment]
    async with running(site):
        _, d = await site.next_link()
        await accept(d, 4)
        assert await receive_through(d, 10) == list(range(5, 11))
    assert order.stamped == 6
    assert order.late == []
