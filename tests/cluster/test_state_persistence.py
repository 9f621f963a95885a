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


def test_replicated_enqueues_are_journaled_by_the_replica_queue_durability() -> None:
    d = genesis_state("site-d", 9)
    feed: list[tuple[Mode, pc.Command]] = [
        (Mode.FULL, pc.QueueDeclare("keep", {"durable": True, "qpid.replicate": "all"})),
        (Mode.FULL, pc.QueueDeclare("temp", {"qpid.replicate": "all"})),
    ]
    st.apply(
        d, pc.Replicated("site-p", 7, 1, 1, 1, tuple(m for m, _ in feed), tuple(c for _, c in feed))
    )
    enqueues = (
        pc.Enqueue("keep", 1, b"kd", "d", DURABLE),
        pc.Enqueue("keep", 2, b"kt", "t"),
        pc.Enqueue("temp", 1, b"td", "d", DURABLE),
    )
    cmd = pc.Replicated("site-p", 7, 2, 1, 2, (Mode.FULL,) * 3, enqueues)
    st.apply(d, cmd)
    journaled = for_journal(d, cmd)
    assert isinstance(journaled, pc.Replicated)
    assert [c.body for c in journaled.commands] == [b"kd", b"", b""]  # type: ignore[attr-defined]
    assert [c.properties for c in journaled.commands] == [DURABLE, {}, DURABLE]  # type: ignore[attr-defined]


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
