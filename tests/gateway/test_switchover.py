"""A planned switchover in the state machines and the tap: P's ``QUIESCE``
closes the replicated queues, every tap forwards the steps, and D is promoted
when it applies the ``HANDOVER``, after everything P forwarded before it.
P's state and tap, D's state, and the events carried between them as the
link carries them (tests/gateway/test_verify.py ``Sites``)."""

from __future__ import annotations

from cluster import state as st
from cluster.state import Promoted, Refused, apply, read_only_origin
from cluster.state.switchover import handed_over
from gateway.fencing import refusal
from protocol import cluster as pc
from protocol import link
from protocol.modes import Mode
from tests.gateway.test_tap import SA, A
from tests.gateway.test_verify import Sites

GUARDED = {"f.q": None, "e.q": None}


def quiesce(to: str = "site-d") -> pc.Switchover:
    return pc.Switchover(to, pc.SwitchoverPhase.QUIESCE, 1_700_000_000_000_000, GUARDED)


def handover(to: str = "site-d") -> pc.Switchover:
    return pc.Switchover(to, pc.SwitchoverPhase.HANDOVER, 1_700_000_000_000_000)


def abort(to: str = "site-d") -> pc.Switchover:
    return pc.Switchover(to, pc.SwitchoverPhase.ABORT, 1_700_000_000_000_000)


def loaded() -> Sites:
    sites = Sites()
    for q in ("f.q", "e.q", "n.q"):
        sites.run(pc.QueueDeclare(q))
        for i in range(3):
            sites.run(pc.Publish("", q, f"{q}-{i}".encode(), f"{q}-{i}"))
    sites.run(pc.Acquire("f.q", SA, 1, 2))  # a consumer holds two
    return sites


def refusals(sites: Sites, cmd: pc.Command) -> list[Refused]:
    """What P's state refused of ``cmd``, applied as its clients' broker."""
    return [e for e in apply(sites.p.state, cmd, sender=A) if isinstance(e, Refused)]


def test_a_quiesce_refuses_publishes_and_acquisitions_of_the_guarded_queues_only() -> None:
    sites = loaded()
    sites.run(quiesce())
    (refused,) = refusals(sites, pc.Publish("", "f.q", b"late", "late"))
    assert refused.reason == st.Reason.SWITCHOVER
    assert refused.condition == "amqp:precondition-failed"
    assert "site-p is switching over to site-d" in refused.description
    assert "'f.q' cannot take publishes" in refused.description
    assert "drgate switchover --abort" in refused.description
    (refused,) = refusals(sites, pc.Acquire("e.q", SA, 1, 1))
    assert "'e.q' cannot be consumed from" in refused.description
    assert refusals(sites, pc.Publish("", "n.q", b"free", "free")) == []  # not replicated
    assert sites.p.state.queues["f.q"].depth == 3


def test_what_a_consumer_held_is_settled_during_the_quiesce_and_reaches_d() -> None:
    sites = loaded()
    sites.run(quiesce())
    held = sites.p.positions("f.q")[:2]
    sites.run(pc.Accept("f.q", SA, held))
    assert sites.p.state.queues["f.q"].depth == 1
    assert sites.d.queues["dr.f.q"].depth == 1


def test_the_handover_promotes_d_after_everything_before_it_and_p_stream_is_refused_after() -> None:
    sites = loaded()
    sites.run(quiesce())
    sites.run(pc.Accept("f.q", SA, sites.p.positions("f.q")[:2]))
    effects: list[object] = []
    event = sites.p.run(handover())
    assert event is not None
    for replicated in pc.decode_frame_untrusted(event.payload):
        effects += apply(sites.d, replicated)
    origin = sites.d.origins["site-p"]
    assert origin.promoted and origin.epoch == 4  # the stream's epoch (3), raised
    assert [e for e in effects if isinstance(e, Promoted)] == [Promoted("site-p", 4)]
    replica = sites.d.queues["dr.f.q"]
    assert read_only_origin(sites.d, replica) is None  # writable: D is the primary
    assert [m.message_id for m in replica.messages.values()] == ["f.q-2"]  # RPO 0
    # P's stream after the handover is refused at D: nothing changes there.
    sites.run(pc.Publish("", "n.q", b"after", "after"))
    sites.run(abort())
    assert sites.d.queues["dr.f.q"].depth == 1


def test_a_handover_to_another_site_changes_nothing_at_d() -> None:
    sites = loaded()
    sites.run(quiesce("site-x"))
    sites.run(handover("site-x"))
    assert not sites.d.origins["site-p"].promoted
    assert read_only_origin(sites.d, sites.d.queues["dr.f.q"]) == "site-p"


def test_an_abort_opens_the_queues_again_and_d_stays_the_dr_site() -> None:
    sites = loaded()
    sites.run(quiesce())
    sites.run(abort())
    assert sites.p.state.switchover_to == "" and sites.p.state.guarded == {}
    assert refusals(sites, pc.Publish("", "f.q", b"again", "again")) == []
    assert not sites.d.origins["site-p"].promoted


def test_the_supersession_that_follows_a_handover_records_it() -> None:
    sites = loaded()
    sites.run(quiesce())
    sites.run(handover())
    sites.run(pc.Superseded("site-d", 1_700_000_000_000_001, GUARDED))
    state = sites.p.state
    assert state.superseded_by == "site-d" and handed_over(state)
    (refused,) = refusals(sites, pc.Publish("", "f.q", b"zombie", "zombie"))
    assert refused.reason == st.Reason.SUPERSEDED
    sites.run(abort())  # too late: the handover happened
    assert state.superseded_by == "site-d" and "f.q" in state.guarded


def test_a_second_quiesce_while_one_is_under_way_changes_nothing() -> None:
    sites = loaded()
    sites.run(quiesce())
    sites.run(pc.Switchover("site-x", pc.SwitchoverPhase.QUIESCE, 5, {"n.q": None}))
    assert sites.p.state.switchover_to == "site-d"
    assert sites.p.state.guarded == GUARDED


def test_the_tap_forwards_every_step_in_the_stream() -> None:
    sites = loaded()
    for cmd in (quiesce(), handover(), abort()):
        assert sites.p.forwarded(cmd) == [(Mode.WIRING, cmd)]


def test_a_switchover_under_way_survives_a_snapshot() -> None:
    sites = loaded()
    sites.run(quiesce())
    restored = st.restore_untrusted(st.snapshot(sites.p.state))
    assert restored.switchover_to == "site-d"
    assert restored.switchover_time_us == 1_700_000_000_000_000
    assert restored.guarded == GUARDED
    assert st.digest(restored) == st.digest(sites.p.state)


def test_a_supersession_without_a_handover_is_a_failover_not_a_handover() -> None:
    sites = loaded()
    sites.run(quiesce("site-x"))  # a switchover to another DR site, under way
    sites.run(pc.Superseded("site-d", 1_700_000_000_000_001, GUARDED))
    assert not handed_over(sites.p.state) and sites.p.state.switchover_to == ""
    sites.run(pc.SetEpoch(4))  # failback: publishes open, consumers wait for D
    assert sites.p.state.failback_cseq == sites.p.state.cseq and not handed_over(sites.p.state)
    assert refusals(sites, pc.Publish("", "f.q", b"again", "again")) == []


def test_the_site_that_handed_over_is_refused_as_a_former_primary_not_a_second_one() -> None:
    sites = loaded()
    sites.run(quiesce())
    sites.run(handover())
    assert list(sites.d.handovers) == ["site-p"]
    hello = link.Hello("site-p", "site-d", 42, 3, 0, 1 << 20)
    refused = refusal(sites.d, site="site-d", hello=hello)
    assert refused is not None and not refused.partitioned
    assert refused.code == link.LinkErrorCode.STALE_EPOCH
    assert "site-p handed over to site-d in a planned switchover" in refused.text
    # A failback at D forgets the handover.
    apply(sites.d, pc.AcceptPrimary("site-p", 5))
    assert sites.d.handovers == {}


def handed_over_then_failed_back() -> Sites:
    """P handed over to D, then ``drgate failback`` at P (``SetEpoch``):
    P's stream goes on, D is resynced by P's next link."""
    sites = loaded()
    sites.run(quiesce())
    sites.run(handover())
    sites.run(pc.Superseded("site-d", 1_700_000_000_000_001, GUARDED))
    sites.run(pc.SetEpoch(5))
    return sites


def test_after_a_failback_the_queues_take_publishes_but_give_nothing_until_d_holds_p() -> None:
    # D forgot what it applied of P (AcceptPrimary), so P's next link resyncs
    # it: an enqueue message published now and taken by a consumer here before
    # the resync's cut would never reach D (found writing the chaos suite's
    # switch back).  Acquisitions wait for D's acknowledgment of the failback.
    sites = handed_over_then_failed_back()
    state = sites.p.state
    failback_cseq = state.cseq
    assert state.superseded_by == "" and not handed_over(state)
    assert refusals(sites, pc.Publish("", "e.q", b"new", "new")) == []
    (refused,) = refusals(sites, pc.Acquire("e.q", SA, 1, 4))
    assert refused.reason == st.Reason.SWITCHOVER
    assert "'e.q' cannot be consumed from" in refused.description
    assert "until the DR site holds site-p's state again" in refused.description
    assert "drgate switchover --abort" in refused.description
    assert sites.p.state.queues["e.q"].depth == 4  # nothing taken
    assert refusals(sites, pc.Acquire("n.q", SA, 1, 1)) == []  # not replicated: open
    # D acknowledges a point before the failback: still closed.
    apply(state, pc.AckWatermark("site-p", 42, failback_cseq - 1, 1))
    assert len(refusals(sites, pc.Acquire("e.q", SA, 1, 1))) == 1
    # D acknowledges the failback's point (the resync's cut is at or above it).
    apply(state, pc.AckWatermark("site-p", 42, failback_cseq + 3, 2))
    assert state.guarded == {}
    assert refusals(sites, pc.Acquire("e.q", SA, 1, 4)) == []


def test_an_abort_opens_the_queues_of_a_failback_whose_dr_site_never_comes() -> None:
    sites = handed_over_then_failed_back()
    sites.run(abort())
    assert sites.p.state.guarded == {}
    assert refusals(sites, pc.Acquire("e.q", SA, 1, 1)) == []


def test_a_failback_waiting_for_d_survives_a_snapshot() -> None:
    sites = handed_over_then_failed_back()
    restored = st.restore_untrusted(st.snapshot(sites.p.state))
    assert restored.failback_cseq == sites.p.state.failback_cseq > 0
    assert restored.guarded == GUARDED == restored.failback_queues
    assert st.digest(restored) == st.digest(sites.p.state)
    # Version 6 had no list of its own: its failback waited on the guarded queues.
    v10 = st.snapshot(sites.p.state)
    # the standing demand, the rejoin, the swap, the failback's queues
    tail = 4 + 2 + 11 + 4 + sum(2 + len(q) for q in GUARDED)
    v6 = v10[:4] + b"\x00\x06" + v10[6:-tail]
    assert st.restore_untrusted(v6).failback_queues == GUARDED


def test_a_failback_before_p_heard_of_its_handover_waits_for_d_too() -> None:
    # D applied the handover and was failed back while P's egress was still
    # cut off: P never recorded the supersession, its queues are closed by
    # the switchover itself.
    sites = loaded()
    sites.run(quiesce())
    sites.run(handover())
    sites.run(pc.SetEpoch(5))
    state = sites.p.state
    assert state.failback_cseq == state.cseq and state.switchover_to == ""
    assert refusals(sites, pc.Publish("", "e.q", b"new", "new")) == []
    assert len(refusals(sites, pc.Acquire("e.q", SA, 1, 1))) == 1


def test_a_switchover_started_during_a_failback_wait_is_not_undone_by_d_acknowledging_it() -> None:
    sites = handed_over_then_failed_back()
    state = sites.p.state
    failback_cseq = state.cseq
    sites.run(quiesce())
    apply(state, pc.AckWatermark("site-p", 42, failback_cseq, 2))
    assert state.failback_cseq == 0 and state.switchover_to == "site-d"
    (refused,) = refusals(sites, pc.Publish("", "f.q", b"late", "late"))
    assert refused.reason == st.Reason.SWITCHOVER  # still quiesced


def test_aborting_a_switchover_during_a_failback_wait_leaves_the_wait() -> None:
    sites = handed_over_then_failed_back()
    state = sites.p.state
    sites.run(quiesce())
    sites.run(abort())  # ends the switchover only
    assert state.switchover_to == "" and state.failback_cseq > 0
    assert refusals(sites, pc.Publish("", "e.q", b"x", "x")) == []
    assert len(refusals(sites, pc.Acquire("e.q", SA, 1, 1))) == 1
    sites.run(abort())  # and then the wait
    assert state.failback_cseq == 0 and state.guarded == {}


def test_after_a_forced_failover_the_queues_the_guard_left_open_wait_for_d_after_the_failback() -> (
    None
):
    # zombie_guard: full (the default) leaves the enqueue queue open to
    # publishes while D is the primary; after the failback a message taken
    # here before D's resync would still never reach D's copy.
    sites = loaded()
    sites.run(
        pc.Superseded("site-d", 1_700_000_000_000_001, {"f.q": None, "e.q": pc.FAILBACK_ONLY})
    )
    assert refusals(sites, pc.Publish("", "e.q", b"open", "open")) == []
    assert len(refusals(sites, pc.Publish("", "f.q", b"shut", "shut"))) == 1
    sites.run(pc.SetEpoch(4))
    (refused,) = refusals(sites, pc.Acquire("e.q", SA, 1, 1))
    assert "until the DR site holds site-p's state again" in refused.description
    assert len(refusals(sites, pc.Acquire("f.q", SA, 1, 1))) == 1
    assert refusals(sites, pc.Acquire("n.q", SA, 1, 1)) == []
    restored = st.restore_untrusted(st.snapshot(sites.p.state))
    assert st.digest(restored) == st.digest(sites.p.state)
    assert restored.failback_queues == sites.p.state.failback_queues == {"f.q": None, "e.q": None}
    apply(sites.p.state, pc.AckWatermark("site-p", 42, sites.p.state.failback_cseq, 2))
    assert refusals(sites, pc.Acquire("e.q", SA, 1, 1)) == []
    assert sites.p.state.failback_queues == {} == sites.p.state.guarded
