"""A hole on the link, end to end in memory: P's real egress streams a real
spool to D's real ingress, a test-only fault drops one forwarded event on its
way out, D refuses the gap, and P heals it with a resync: D ends equal to P,
every message once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cluster import state as st
from cluster.addresses import Address
from gateway.egress import Egress
from gateway.ingress import Ingress
from gateway.roles import RoleSignal, SidecarRole
from gateway.spool import Spool
from gateway.tap import Tap
from protocol import cluster as pc
from protocol.errors import BusError
from tests.support.linkpeer import MemberStandIn, sidecar_config

MESSAGES = 8
LOST = 5  # the forwarded event the faulty sender drops (a publish)


def primary(tmp_path: Path) -> tuple[MemberStandIn, Tap, Spool]:
    """P's state after a declare and MESSAGES publishes to q-full, every
    event tapped into a spool, as P's sidecar does."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = sidecar_config(tmp_path, primary=True, site="site-p", peer="site-d")
    member = MemberStandIn("site-p")
    tap = Tap(config.rules, origin_cluster="site-p")
    tap.resync_rules(member.state)
    spool = Spool.open(
        config.spool_dir, max_bytes=1 << 20, segment_bytes=1 << 16, fsync="never", incarnation=1
    )
    commands: list[pc.Command] = [pc.QueueDeclare("q-full")]
    commands += [pc.Publish("", "q-full", f"m-{n}".encode()) for n in range(1, MESSAGES + 1)]
    for cmd in commands:
        effects = member.apply(cmd)
        event = tap.on_command(member.state, cmd, effects, 1_000 * member.state.cseq)
        if event is not None:
            spool.append_many([(event.seq, event.time_us, event.payload, event.prev_seq)])
    return member, tap, spool


async def run_link(
    tmp_path: Path,
    p: MemberStandIn,
    tap: Tap,
    spool: Spool,
    ingress: Ingress,
    done: trio.Event,
    *,
    prepare: Callable[[Egress], None] = lambda egress: None,
) -> Egress:
    """P's real egress streaming ``spool`` to D's real ingress over in-memory
    connections until ``done``; ``prepare`` sees the egress before it runs."""
    async with trio.open_nursery() as nursery:

        async def connect(address: Address) -> trio.abc.Stream:
            ours, theirs = trio.testing.memory_stream_pair()
            nursery.start_soon(ingress.handle, theirs)
            return ours

        config = sidecar_config(tmp_path / "p", primary=True, site="site-p", peer="site-d")
        egress = Egress(
            config,
            p,  # type: ignore[arg-type]
            tap,
            spool=lambda: spool,
            role=lambda: SidecarRole.EGRESS,
            roles=RoleSignal(),
            connect=connect,
        )
        prepare(egress)
        nursery.start_soon(egress.serve)
        with trio.fail_after(60):
            await done.wait()
        nursery.cancel_scope.cancel()
    return egress


async def test_a_hole_on_the_link_is_refused_by_d_and_healed_by_a_resync(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, tap, spool = primary(tmp_path / "p")
    lost = sorted(seq for seq, *_ in spool.read_after(0))[LOST]
    caught_up = trio.Event()

    class DrSite(MemberStandIn):
        def apply(self, *commands: pc.Command) -> list[Any]:
            effects = super().apply(*commands)
            if st.applied(self.state, "site-p", 1) >= p.state.cseq:
                caught_up.set()
            return effects

    d = DrSite("site-d")
    for _seq, _time_us, payload, _prev in spool.read_after(0)[:3]:  # D holds a prefix
        d.apply(*pc.decode_frame_untrusted(payload))
    (tmp_path / "d").mkdir()
    d_config = sidecar_config(tmp_path / "d", primary=False, site="site-d", peer="site-p")
    ingress = Ingress(d_config, d, role=lambda: SidecarRole.INGRESS, active=lambda: None)  # type: ignore[arg-type]

    read_after = spool.read_after
    faulty = [True]

    def dropping(seq: int, max_bytes: int = 1 << 20) -> list[Any]:
        """The first connection's sender skips one forwarded event."""
        events = read_after(seq, max_bytes)
        if faulty[0]:
            events = [e for e in events if e[0] != lost]
        return events

    monkeypatch.setattr(spool, "read_after", dropping)

    def gap_healed(egress: Egress) -> None:
        gap_reported = egress._gap_reported

        def gap(address: str, text: str) -> None:
            gap_reported(address, text)
            faulty[0] = False  # the fault is gone; the spool itself was whole

        monkeypatch.setattr(egress, "_gap_reported", gap)

    egress = await run_link(tmp_path, p, tap, spool, ingress, caught_up, prepare=gap_healed)

    assert egress.gaps == 1
    assert ingress.link_statistics().gaps_total == 1
    assert egress.status.resync.total == 1  # the gap, healed by one resync
    assert st.queue_digest(d.state, "q-full") == st.queue_digest(p.state, "q-full")
    bodies = [m.body for m in d.state.queues["q-full"].messages.values()]
    assert bodies == [f"m-{n}".encode() for n in range(1, MESSAGES + 1)]


async def test_an_event_that_fails_to_apply_is_applied_later_never_dropped_as_a_duplicate(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The head-of-line pattern that lost data in another broker's
    geo-replication: event k fails to apply at D while k+1..n are on their
    way; k is sent again.  Here k's trip through D's bus fails once: the link
    must stop before anything after k is applied or acked, and the next
    connection applies k, then the rest, each once and in order."""
    p, tap, spool = primary(tmp_path / "p")
    seqs = sorted(seq for seq, *_ in spool.read_after(0))
    k = seqs[LOST]
    caught_up = trio.Event()
    failed = [False]

    class FlakyDrSite(MemberStandIn):
        async def submit_and_wait(self, *commands: pc.Command) -> int:
            if not failed[0] and any(
                isinstance(c, pc.Replicated) and c.origin_cseq == k for c in commands
            ):
                failed[0] = True
                raise BusError(f"test: the frame holding event {k} did not make it")
            cseq = await super().submit_and_wait(*commands)
            if st.applied(self.state, "site-p", 1) >= p.state.cseq:
                caught_up.set()
            return cseq

    d = FlakyDrSite("site-d")
    for _seq, _time_us, payload, _prev in spool.read_after(0)[:3]:  # D holds a prefix
        d.apply(*pc.decode_frame_untrusted(payload))
    (tmp_path / "d").mkdir()
    d_config = sidecar_config(tmp_path / "d", primary=False, site="site-d", peer="site-p")
    ingress = Ingress(d_config, d, role=lambda: SidecarRole.INGRESS, active=lambda: None)  # type: ignore[arg-type]
    egress = await run_link(tmp_path, p, tap, spool, ingress, caught_up)

    assert failed[0] and egress.status.reconnects >= 1  # the link stopped once
    replicated = [c for c in d.applied if isinstance(c, pc.Replicated)]
    assert [c.origin_cseq for c in replicated] == seqs, "dropped, doubled or reordered"
    assert d.state.counters["r1_duplicates"] == 0
    assert st.queue_digest(d.state, "q-full") == st.queue_digest(p.state, "q-full")
