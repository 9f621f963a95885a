"""Continuous verification: a ``VerifyPoint`` on P's bus becomes, at every
tap, one ``Verify`` per queue D copies whole; D's state compares its replica
with it (cluster/state/replica.py ``verify``) and says so in a ``Verified``
effect.  P's state and tap, D's state, and the events carried between them
as the link carries them."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import trio
import trio.testing

from cluster.state import QueueDeleted, Verified, apply, new_state
from gateway.capture import CaptureConfig
from gateway.commands import verify as verify_command
from gateway.linkconfig import DEFAULT_VERIFY_S
from gateway.sidecar import Sidecar
from gateway.verification import Verifications
from protocol import cluster as pc
from protocol.capture import Stream
from protocol.modes import Mode
from tests.gateway.test_sidecar import PrimarySite
from tests.gateway.test_tap import SA, Site
from tests.support.linkpeer import sidecar_config
from tests.support.membus import MemoryBus, open_memory_member


class Sites:
    """P (tap included) and D, with every event P's tap makes applied at D."""

    def __init__(self, rules: str | None = None) -> None:
        self.p = Site() if rules is None else Site(rules)
        self.d = new_state()
        apply(self.d, pc.Genesis("site-d", 7))
        self.verified: list[Verified] = []

    def run(self, cmd: pc.Command) -> None:
        event = self.p.run(cmd)
        if event is None:
            return
        for replicated in pc.decode_frame_untrusted(event.payload):
            effects = apply(self.d, replicated)
            self.verified += [e for e in effects if isinstance(e, Verified)]

    def verify(self) -> dict[str, Verified]:
        self.verified.clear()
        self.run(pc.VerifyPoint(1_000))
        return {v.queue: v for v in self.verified}


def busy() -> Sites:
    """f.q (full) and e.q (enqueue) with messages published and some consumed."""
    sites = Sites()
    for q in ("f.q", "e.q", "n.q"):
        sites.run(pc.QueueDeclare(q))
        for i in range(5):
            sites.run(pc.Publish("", q, f"{q}-{i}".encode(), f"{q}-{i}"))
    for q in ("f.q", "e.q"):
        sites.run(pc.Acquire(q, SA, 1, 2))
        sites.run(pc.Accept(q, SA, tuple(sites.p.positions(q)[:2])))
    return sites


def test_replicas_that_kept_up_verify_and_the_point_names_every_queue_d_copies_whole() -> None:
    sites = busy()
    got = sites.verify()
    assert sorted(got) == ["dr.e.q", "dr.f.q"]  # none: not replicated; wiring: no messages
    assert all(v.ok and v.detail == "" for v in got.values()), got
    assert got["dr.f.q"].mode == Mode.FULL and got["dr.e.q"].mode == Mode.ENQUEUE
    assert got["dr.f.q"].origin_cseq == sites.p.state.cseq
    # D's own consumers take from an enqueue replica: still verified.
    d_enq = sites.d.queues["dr.e.q"]
    d_enq.remove(next(iter(d_enq.messages)))
    assert sites.verify()["dr.e.q"].ok


def test_a_full_replica_that_lost_a_message_is_reported_naming_the_queue() -> None:
    sites = busy()
    replica = sites.d.queues["dr.f.q"]
    replica.remove(next(reversed(replica.messages)))  # the test-only corruption
    got = sites.verify()
    assert not got["dr.f.q"].ok
    assert got["dr.f.q"].detail == "2 messages here, 3 at 'site-p'"
    assert got["dr.e.q"].ok


def test_a_full_replica_with_a_changed_body_is_reported() -> None:
    sites = busy()
    replica = sites.d.queues["dr.f.q"]
    pos, msg = next(iter(replica.messages.items()))
    replica.messages[pos] = msg.__class__(
        msg.pos, b"tampered", msg.message_id, msg.properties, msg.delivery_count, msg.origin_pos
    )
    got = sites.verify()["dr.f.q"]
    assert (got.ok, got.detail) == (False, "same depth (3), different messages (content digest)")


def test_an_enqueue_replica_that_missed_the_newest_publish_is_reported() -> None:
    sites = busy()
    sites.d.queues["dr.e.q"].replica.high_pos -= 1  # type: ignore[union-attr]
    got = sites.verify()["dr.e.q"]
    assert not got.ok
    assert got.detail == "received up to origin position 4 here; 'site-p' still holds position 5"


def test_a_missing_replica_is_reported_and_a_queue_with_message_filters_is_not_compared() -> None:
    sites = busy()
    sites.run(pc.QueueDeclare("s.q"))  # full, with max_message_bytes: D may lack some
    del sites.d.queues["dr.f.q"]
    got = sites.verify()
    assert "s.q" not in got
    assert (got["dr.f.q"].ok, got["dr.f.q"].detail) == (
        False,
        "no replica of 'site-p' named 'dr.f.q' here",
    )


def test_a_verify_point_changes_nothing_at_p_and_a_bare_verify_nothing_at_d() -> None:
    sites = busy()
    before = sites.p.state.queues["f.q"].depth
    sites.verify()
    assert sites.p.state.queues["f.q"].depth == before
    assert apply(sites.d, pc.Verify("dr.f.q", 99)) == []


async def test_only_the_egress_posts_a_verify_point_once_a_period(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        site = PrimarySite(tmp_path, nursery)
        first, second, third = await site.start_three()
        assert first.config.link.verify_s == DEFAULT_VERIFY_S
        points = [s.tap.commands for s in (first, second, third)]
        await trio.sleep(2.5 * DEFAULT_VERIFY_S)
        # Every tap sees each point; only the egress posted them: two, not six.
        assert [c["VERIFY_POINT"] for c in points] == [2, 2, 2]
        nursery.cancel_scope.cancel()


def test_d_keeps_the_last_result_per_queue_and_counts_the_mismatches() -> None:
    sites = busy()
    seen = Verifications()
    seen.record(list(sites.verify().values()), time_us=5)
    replica = sites.d.queues["dr.f.q"]
    replica.remove(next(reversed(replica.messages)))
    seen.record(list(sites.verify().values()), time_us=6)
    section = seen.section()
    assert section.mismatched == ["dr.f.q"]
    assert (section.checks_total, section.mismatches_total) == (4, 1)
    assert section.queues["dr.f.q"] == {
        "ok": False,
        "mode": "full",
        "origin": "site-p",
        "origin_cseq": sites.p.state.cseq,
        "detail": "2 messages here, 3 at 'site-p'",
        "time_us": 6,
    }
    assert section.queues["dr.e.q"]["ok"] is True
    # A replica deleted at D is no longer reported.
    seen.record([QueueDeleted("dr.f.q", 2)])
    assert seen.section().mismatched == []


def result(cseq: int, ok: bool, detail: str = "") -> dict[str, object]:
    return {"ok": ok, "mode": "full", "origin": "site-p", "origin_cseq": cseq,
            "detail": detail, "time_us": 0}  # fmt: skip


def test_drgate_verify_shows_the_newest_result_per_queue_and_exits_by_the_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    documents = [
        {"verify": {"queues": {"orders": result(5, True)}}},
        {"verify": {"queues": {"orders": result(9, False, "2 messages here, 3 at 'site-p'")}}},
        {"url": "http://d3:9465/status", "error": "unreachable: refused"},
    ]
    newest = verify_command.latest(documents)
    assert newest["orders"]["origin_cseq"] == 9
    assert verify_command.report(newest, 0, ["d1"], as_json=False) == 1
    said = capsys.readouterr().out
    assert "orders" in said and "DIFFERS: 2 messages here, 3 at 'site-p'" in said
    assert "drgate resync" in said
    # Asked for a comparison at cseq 10, D has only 9: not there yet.
    assert verify_command.report(newest, 10, ["d1"], as_json=True) == 2
    assert json.loads(capsys.readouterr().out)["late"] == ["orders"]
    assert verify_command.report({"orders": result(12, True)}, 10, ["d1"], as_json=False) == 0
    assert verify_command.report({}, 0, ["http://d1:9465/status"], as_json=False) == 2
    assert "none of http://d1:9465/status reports a comparison" in capsys.readouterr().out


async def test_a_d_sidecar_whose_site_is_recovering_neither_compares_nor_captures(
    tmp_path: Path,
) -> None:
    # (The real clock: the capture's files are made in a worker thread.)
    # The 200-fault corosync run (seed 2025, 29 Nov): a D node that started
    # its site over after a partition applied the events it had buffered to
    # the empty state its journals' recovery was about to replace, and
    # logged "no replica of 'site-p' named 'q-full' here".  Until the site's
    # state is installed there is no copy to compare, and no application to
    # capture: the recovery replaces them.
    config = sidecar_config(tmp_path, primary=False, site="site-d", peer="site-p")
    config = dataclasses.replace(
        config,
        bus=dataclasses.replace(config.bus, expect_brokers=1),
        capture=CaptureConfig(str(tmp_path / "cap"), streams=frozenset({Stream.INGESTED})),
    )
    sites = busy()
    event = sites.p.run(pc.VerifyPoint(1_000))
    assert event is not None
    [replicated] = pc.decode_frame_untrusted(event.payload)
    async with trio.open_nursery() as nursery:
        sidecar = Sidecar(config, open_member=open_memory_member(MemoryBus(group="site-d")))
        serve = functools.partial(PrimarySite._serve, task_status=trio.TASK_STATUS_IGNORED)
        nursery.start_soon(serve, sidecar)  # it is ready once its site is
        with trio.fail_after(30):
            await sidecar.member.ready.wait()
            assert sidecar.state.incarnation == 0  # waiting for its brokers' journals
            await sidecar.member.submit_and_wait(replicated)  # applied here
        assert sidecar.verifications.section().checks_total == 0
        assert sidecar.capture is not None
        await sidecar.capture.flush(closing=True)
        assert sidecar.capture.statistics()["records_total"].get("ingested", 0) == 0
        nursery.cancel_scope.cancel()
