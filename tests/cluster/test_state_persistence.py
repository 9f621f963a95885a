"""cluster.state.persistence: what a node journals of a message, and what a
whole-site recovery keeps (a durable message on a durable queue, durable
queues, exchanges and bindings) and drops (everything transient)."""

from __future__ import annotations

from cluster import state as st
from cluster.state.persistence import (
    drop_transient,
    for_journal,
    publish_persistent,
    queue_durable,
    take_recovery,
)
from protocol import cluster as pc
from protocol.modes import Mode
from protocol.values import ValueMap
from tests.support.state import Member, genesis_state

CLIENT = Member(1, 10)
SID = st.session_id(1, 10, 1)
DURABLE: ValueMap = {pc.DURABLE_PROPERTY: True}


def mixed_site() -> st.SiteState:
    """Durable queue ``keep``, non-durable ``temp``, ``last`` with
    qpid.persist_last_node, ``capped`` (non-durable, byte limit); durable
    fanout ``dx`` bound to keep and temp, non-durable ``tx`` bound to keep;
    on each queue a durable message and a transient one."""
    s = genesis_state("site-p", 7)
    st.apply(s, pc.QueueDeclare("keep", {"durable": True}))
    st.apply(s, pc.QueueDeclare("temp"))
    st.apply(s, pc.QueueDeclare("last", {"qpid.persist_last_node": "true"}))
    st.apply(s, pc.QueueDeclare("capped", {"qpid.max_size": 10_000}))
    st.apply(s, pc.ExchangeDeclare("dx", pc.ExchangeType.FANOUT, {"durable": True}))
    st.apply(s, pc.ExchangeDeclare("tx", pc.ExchangeType.FANOUT))
    for x, q in (("dx", "keep"), ("dx", "temp"), ("tx", "keep")):
        st.apply(s, pc.Bind(x, q))
    for q in ("keep", "temp", "last", "capped"):
        st.apply(s, pc.Publish("", q, f"{q}-durable".encode(), "d", DURABLE))
        st.apply(s, pc.Publish("", q, f"{q}-transient".encode(), "t"))
    return s


def bodies(s: st.SiteState) -> dict[str, list[bytes]]:
    return {q.name: [m.body for m in q.messages.values()] for q in s.queues.values()}


def test_durability_comes_from_the_declare_and_the_header() -> None:
    s = mixed_site()
    assert [n for n, q in s.queues.items() if queue_durable(q)] == ["keep", "last"]
    assert publish_persistent(s, ("temp", "keep"), DURABLE)
    assert not publish_persistent(s, ("keep",), None)  # transient message
    assert not publish_persistent(s, ("temp",), DURABLE)  # non-durable queue
    assert publish_persistent(s, ("last",), None)  # qpid.persist_last_node: every message


def test_a_bad_durable_argument_is_refused_at_the_declare() -> None:
    s = genesis_state("site-p", 7)
    eff = st.apply(s, pc.QueueDeclare("q", {"durable": "maybe"}), sender=CLIENT)
    refused = [e for e in eff if isinstance(e, st.Refused)]
    assert refused and "durable='maybe' is not true or false" in refused[0].description
    assert "q" not in s.queues


def test_the_journal_gets_no_body_of_a_message_that_does_not_persist() -> None:
    s = mixed_site()
    journaled = {
        q: [
            for_journal(s, pc.Publish("", q, b"durable", "d", DURABLE)).body,  # type: ignore[attr-defined]
            for_journal(s, pc.Publish("", q, b"transient", "t")).body,  # type: ignore[attr-defined]
        ]
        for q in ("keep", "temp", "last", "capped")
    }
    assert journaled == {
        "keep": [b"durable", b""],
        "temp": [b"", b""],
        "last": [b"durable", b"transient"],
        # A byte limit refuses by bytes: the replay must count them all.
        "capped": [b"durable", b"transient"],
    }
    # Routed to a durable and a non-durable queue: kept for the durable one.
    assert for_journal(s, pc.Publish("dx", "", b"both", "b", DURABLE)).body == b"both"  # type: ignore[attr-defined]
    other = pc.Acquire("keep", SID, 0, 1)
    assert for_journal(s, other) is other


def replicated(d: st.SiteState, cseq: int, feed: list[tuple[Mode, pc.Command]]) -> pc.Replicated:
    """``feed`` applied at ``d`` as P's command ``cseq``; returns the command."""
    modes, commands = tuple(m for m, _ in feed), tuple(c for _, c in feed)
    cmd = pc.Replicated("site-p", 7, cseq, 1, cseq, modes, commands)
    st.apply(d, cmd)
    return cmd


# Each replica queue at D: its mode and whether it is durable at P.
REPLICAS = {
    "full-keep": (Mode.FULL, True),
    "full-temp": (Mode.FULL, False),
    "enq-keep": (Mode.ENQUEUE, True),
    "enq-temp": (Mode.ENQUEUE, False),
    "wiring-temp": (Mode.WIRING, False),
}


def dr_site() -> tuple[st.SiteState, pc.Replicated]:
    """D with the :data:`REPLICAS` and a non-durable replica fanout ``rx``
    bound to full-temp, a local non-durable queue ``local``; on each queue
    with messages a durable one and a transient one.  Returns the state and
    the Replicated command of the enqueues."""
    d = genesis_state("site-d", 9)
    declares: list[tuple[Mode, pc.Command]] = [
        (mode, pc.QueueDeclare(name, {"durable": True} if durable else {}))
        for name, (mode, durable) in REPLICAS.items()
    ]
    declares.append((Mode.WIRING, pc.ExchangeDeclare("rx", pc.ExchangeType.FANOUT)))
    declares.append((Mode.WIRING, pc.Bind("rx", "full-temp")))
    replicated(d, 1, declares)
    enqueues: list[tuple[Mode, pc.Command]] = []
    for name, (mode, _durable) in REPLICAS.items():
        if mode != Mode.WIRING:
            enqueues.append((mode, pc.Enqueue(name, 1, f"{name}-durable".encode(), "d", DURABLE)))
            enqueues.append((mode, pc.Enqueue(name, 2, f"{name}-transient".encode(), "t")))
    cmd = replicated(d, 2, enqueues)
    st.apply(d, pc.QueueDeclare("local"))
    st.apply(d, pc.Publish("", "local", b"local-durable", "d", DURABLE))
    return d, cmd


def test_replicated_enqueues_keep_every_body_of_a_full_replica() -> None:
    d, cmd = dr_site()
    journaled = for_journal(d, cmd)
    assert isinstance(journaled, pc.Replicated)
    got = {(c.queue, c.message_id): c.body for c in journaled.commands}  # type: ignore[attr-defined]
    # A full replica is P's queue: P still holds its transient messages after
    # D's power cut, so D's journal must too.  An enqueue copy is D's own.
    assert got == {
        ("full-keep", "d"): b"full-keep-durable",
        ("full-keep", "t"): b"full-keep-transient",
        ("full-temp", "d"): b"full-temp-durable",
        ("full-temp", "t"): b"full-temp-transient",
        ("enq-keep", "d"): b"enq-keep-durable",
        ("enq-keep", "t"): b"",
        ("enq-temp", "d"): b"",
        ("enq-temp", "t"): b"",
    }
    assert [c.properties for c in journaled.commands][:2] == [DURABLE, {}]  # type: ignore[attr-defined]
    restored = st.restore_untrusted(st.snapshot(d, transient_bodies=False))
    assert bodies(restored)["full-temp"] == [b"full-temp-durable", b"full-temp-transient"]
    assert bodies(restored)["enq-keep"] == [b"enq-keep-durable", b""]


def test_d_own_recovery_keeps_replicas_and_full_replicas_messages() -> None:
    d, _cmd = dr_site()
    dropped = drop_transient(d)
    assert bodies(d) == {
        "full-keep": [b"full-keep-durable", b"full-keep-transient"],
        "full-temp": [b"full-temp-durable", b"full-temp-transient"],
        "enq-keep": [b"enq-keep-durable"],  # D's own transient message: gone
        "enq-temp": [],  # on a queue that is not durable nothing is persistent
        "wiring-temp": [],
    }
    assert dropped.queues == ("local",)
    assert dropped.messages == {"enq-keep": 1, "enq-temp": 2}
    assert dropped.exchanges == ()
    assert list(d.exchanges["rx"].bindings) == [("full-temp", "")]
    assert all(q.replica is not None for q in d.queues.values())


def test_a_checkpoint_snapshot_leaves_out_transient_bodies_and_keeps_every_position() -> None:
    s = mixed_site()
    restored = st.restore_untrusted(st.snapshot(s, transient_bodies=False))
    assert bodies(restored) == {
        "keep": [b"keep-durable", b""],
        "temp": [b"", b""],
        "last": [b"last-durable", b"last-transient"],
        "capped": [b"capped-durable", b"capped-transient"],
    }
    assert st.snapshot(s) == st.snapshot(st.restore_untrusted(st.snapshot(s)))  # default: whole


def test_the_recovery_drops_transient_messages_queues_exchanges_and_bindings() -> None:
    s = mixed_site()
    st.apply(s, pc.SessionOpen(SID), sender=CLIENT)
    st.apply(s, pc.Acquire("keep", SID, 0, 2), sender=CLIENT)  # holds both messages of keep
    st.apply(s, pc.Acquire("temp", SID, 0, 1), sender=CLIENT)
    twin = st.restore_untrusted(st.snapshot(s))
    dropped = drop_transient(s)
    assert bodies(s) == {"keep": [b"keep-durable"], "last": [b"last-durable", b"last-transient"]}
    assert dropped.queues == ("temp", "capped")
    assert dropped.exchanges == ("tx",)
    assert dropped.messages == {"keep": 1}
    assert set(dropped.touched_queues()) == {"temp", "capped", "keep"}
    assert list(s.exchanges["dx"].bindings) == [("keep", "")]  # dx's binding to temp is gone
    assert "tx" not in s.exchanges and "amq.direct" in s.exchanges
    # The session holds what is left, and nothing of what is gone.
    assert s.sessions[SID].acquired == {"keep": {1: 0}}
    assert s.queues["keep"].bytes == len(b"keep-durable")
    # Every member that drops from the same state gets the same state.
    drop_transient(twin)
    assert st.digest(twin) == st.digest(s)
    assert not drop_transient(s)  # nothing transient left


def test_a_recovery_is_recorded_in_the_state_it_continues_from() -> None:
    s = mixed_site()
    dropped = take_recovery(s)
    assert dropped.queues == ("temp", "capped")
    assert s.recoveries == [st.Recovery(1, s.cseq, True)]
    st.apply(s, pc.QueueDeclare("after", {"durable": True}))
    twin = st.restore_untrusted(st.snapshot(s))
    assert not take_recovery(s)  # nothing transient: recorded all the same
    assert s.recoveries == [st.Recovery(1, s.cseq - 1, True), st.Recovery(2, s.cseq, False)]
    take_recovery(twin)
    assert st.digest(twin) == st.digest(s)


def test_the_recovery_returns_what_the_consumers_of_the_old_site_held() -> None:
    # A whole-site restart ends every connection: no member of the old bus is
    # left to leave the view, so nothing else closes its sessions.  Before
    # the fix the journal's sessions stayed open after the recovery and their
    # messages stayed acquired, counted in the depth and never delivered.
    s = mixed_site()
    st.apply(s, pc.SessionOpen(SID), sender=CLIENT)
    st.apply(s, pc.Acquire("keep", SID, 0, 2), sender=CLIENT)
    st.apply(s, pc.Acquire("last", SID, 0, 1), sender=CLIENT)
    st.apply(s, pc.MemberReady(pc.Role.BROKER, CLIENT.node, CLIENT.pid), sender=CLIENT)
    twin = st.restore_untrusted(st.snapshot(s))
    dropped = take_recovery(s)
    assert s.sessions == {}
    assert dropped.released == {"keep": 1, "last": 1}  # keep's transient one is dropped
    for name in ("keep", "last"):
        q = s.queues[name]
        assert q.acquired == {}
        assert sorted(q.available) == sorted(q.messages)
    counts = {
        n: [m.delivery_count for m in s.queues[n].messages.values()] for n in ("keep", "last")
    }
    # Went out and came back; never acquired, but may have gone out after the
    # journal's last commit (a power loss): one possible delivery each, once.
    assert counts == {"keep": [1], "last": [1, 1]}
    assert s.ready == {}  # the old members' readiness goes with them
    take_recovery(twin)
    assert st.digest(twin) == st.digest(s)


def test_after_a_recovery_every_message_a_consumer_could_take_may_have_gone_out() -> None:
    # Chaos, CI (seed 1415117289): messages sent after the journal's last
    # commit came again unmarked after a power loss.
    s = mixed_site()
    before = {n: len(q.messages) for n, q in s.queues.items()}
    take_recovery(s)
    for name, q in s.queues.items():
        assert [m.delivery_count for m in q.messages.values()] == [1] * len(q.messages), name
    assert any(before.values())


def test_a_read_only_full_replica_is_not_marked_at_d_own_recovery() -> None:
    # No consumer can take from it until a promotion: nothing went out.
    d, _cmd = dr_site()
    take_recovery(d)
    counts = {n: {m.delivery_count for m in q.messages.values()} for n, q in d.queues.items()}
    assert counts["full-keep"] == counts["full-temp"] == {0}
    assert counts["enq-keep"] == {1}
