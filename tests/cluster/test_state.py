"""cluster.state: queues, exchanges, routing, sessions (local commands)."""

from __future__ import annotations

import pytest
from proton import Message

from cluster.state import (
    Delivered,
    Dequeued,
    Enqueued,
    GenesisApplied,
    QueueDeleted,
    Reason,
    Refused,
    Released,
    Settled,
    SiteState,
    apply,
    list_queues,
    members_left,
    messages,
    new_state,
    queue_args,
    ready_members,
    route,
    session_holdings,
    session_id,
    session_owner,
    statistics,
    topic_matches,
)
from cluster.state.effects import Message as StoredMessage
from cluster.state.model import TEMPORARY_ARG
from protocol import cluster as pc
from protocol.modes import Role
from protocol.values import Value
from tests.support.state import Member, genesis_state

A = Member(1, 100)
B = Member(2, 200)
SA = session_id(1, 100, 1)
SB = session_id(2, 200, 1)


def site(*queues: str) -> SiteState:
    st = genesis_state("P", 42)
    for q in queues:
        apply(st, pc.QueueDeclare(q))
    apply(st, pc.SessionOpen(SA), sender=A)
    apply(st, pc.SessionOpen(SB), sender=B)
    return st


def publish(st: SiteState, queue: str, *bodies: bytes) -> None:
    for i, body in enumerate(bodies):
        eff = apply(st, pc.Publish("", queue, body, ref=i + 1), sender=A)
        assert isinstance(eff[-1], Settled), eff


def bodies(st: SiteState, queue: str) -> list[bytes]:
    return [m.body for m in messages(st, queue)]


# --------------------------------------------------------------------------


def test_session_id_round_trip_and_bounds() -> None:
    sid = session_id(5, 4_000_000, 65535)
    assert session_owner(sid) == (5, 4_000_000)
    assert sid & 0xFFFF == 65535
    assert session_owner(session_id(0xFFFFFF, 0xFFFFFF, 0)) == (0xFFFFFF, 0xFFFFFF)
    for args in [(1 << 24, 0, 0), (0, 1 << 24, 0), (0, 0, 1 << 16), (-1, 0, 0)]:
        with pytest.raises(ValueError, match="does not fit"):
            session_id(*args)


@pytest.mark.parametrize(
    ("pattern", "key", "expected"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.c", False),
        ("a.*", "a.b", True),
        ("a.*", "a", False),
        ("a.*", "a.b.c", False),
        ("*.b.*", "a.b.c", True),
        ("a.#", "a", True),
        ("a.#", "a.b.c", True),
        ("#", "", True),
        ("#", "x.y", True),
        ("#.c", "a.b.c", True),
        ("#.c", "c", True),
        ("#.c", "a.b", False),
        ("a.#.c", "a.c", True),
        ("a.#.c", "a.x.y.c", True),
        ("a.#.c", "a.x.y.d", False),
        ("a.#.#.c", "a.c", True),
        ("#.*.*", "a", False),
        ("#.*", "a", True),
        ("*", "", True),  # one (empty) word
        ("*.*", "a", False),
    ],
)
def test_topic_matching(pattern: str, key: str, expected: bool) -> None:
    assert topic_matches(pattern, key) is expected


def test_predeclared_exchanges_and_default_routing() -> None:
    st = site("q1", "q2")
    assert route(st, "", "q1") == ["q1"]
    assert route(st, "", "nope") == []
    assert route(st, "missing", "k") == []
    apply(st, pc.Bind("amq.direct", "q1", "k"))
    apply(st, pc.Bind("amq.direct", "q2", "k"))
    apply(st, pc.Bind("amq.direct", "q2", "other"))
    apply(st, pc.Bind("amq.fanout", "q2"))
    apply(st, pc.Bind("amq.fanout", "q1"))
    apply(st, pc.Bind("amq.topic", "q1", "a.*"))
    apply(st, pc.Bind("amq.topic", "q2", "a.#"))
    apply(st, pc.Bind("amq.topic", "q1", "#"))  # q1 twice: routed once
    assert route(st, "amq.direct", "k") == ["q1", "q2"]
    assert route(st, "amq.direct", "other") == ["q2"]
    assert route(st, "amq.fanout", "anything") == ["q2", "q1"]
    assert route(st, "amq.topic", "a.b") == ["q1", "q2"]
    assert route(st, "amq.topic", "a.b.c") == ["q2", "q1"]
    assert route(st, "amq.topic", "z") == ["q1"]
    apply(st, pc.Unbind("amq.topic", "q1", "#"))
    assert route(st, "amq.topic", "z") == []


def test_publish_fanout_appends_to_every_target_with_its_own_pos() -> None:
    st = site("q1", "q2")
    publish(st, "q1", b"x")  # q1 is now one ahead
    apply(st, pc.Bind("amq.fanout", "q1"))
    apply(st, pc.Bind("amq.fanout", "q2"))
    eff = apply(st, pc.Publish("amq.fanout", "", b"y", ref=9), sender=B)
    assert eff == [Enqueued("q1", 2), Enqueued("q2", 1), Settled(9, B, ("q1", "q2"))]
    assert bodies(st, "q1") == [b"x", b"y"]
    assert bodies(st, "q2") == [b"y"]


def test_unroutable_publish_is_settled_and_dropped() -> None:
    st = site("q")
    eff = apply(st, pc.Publish("amq.direct", "nobody", b"x", ref=3), sender=A)
    assert eff == [Settled(3, A, ())]
    assert statistics(st)["messages"] == 0


@pytest.mark.parametrize(
    ("command", "reason", "condition", "words"),
    [
        (pc.Publish("", "nope", b"x", ref=5), Reason.UNKNOWN_QUEUE, "amqp:not-found", "'nope'"),
        (pc.Publish("ex", "k", b"x", ref=5), Reason.UNKNOWN_EXCHANGE, "amqp:not-found", "'ex'"),
        (pc.Acquire("nope", SA), Reason.UNKNOWN_QUEUE, "amqp:not-found", "'nope'"),
        (pc.Acquire("q", 12345), Reason.UNKNOWN_SESSION, "amqp:illegal-state", "not open"),
        (pc.Purge("nope"), Reason.UNKNOWN_QUEUE, "amqp:not-found", "'nope'"),
        (pc.QueueDelete("nope"), Reason.UNKNOWN_QUEUE, "amqp:not-found", "'nope'"),
        (pc.Bind("ex", "q"), Reason.UNKNOWN_EXCHANGE, "amqp:not-found", "'ex'"),
        (pc.Bind("amq.direct", "nope"), Reason.UNKNOWN_QUEUE, "amqp:not-found", "'nope'"),
        (pc.Bind("", "q", "q"), Reason.PREDECLARED, "amqp:not-allowed", "default exchange"),
        (pc.ExchangeDelete("amq.topic"), Reason.PREDECLARED, "amqp:not-allowed", "predeclared"),
        (pc.ExchangeDelete("ex"), Reason.UNKNOWN_EXCHANGE, "amqp:not-found", "'ex'"),
        (
            pc.ExchangeDeclare("amq.fanout", pc.ExchangeType.TOPIC),
            Reason.TYPE_MISMATCH,
            "amqp:precondition-failed",
            "fanout",
        ),
        (
            pc.QueueDeclare("r", {"qpid.replicate": "some"}),
            Reason.INVALID_ARGUMENT,
            "amqp:invalid-field",
            "qpid.replicate",
        ),
        (
            pc.QueueDeclare("r", {"qpid.queue_event_generation": 3}),
            Reason.INVALID_ARGUMENT,
            "amqp:invalid-field",
            "qpid.queue_event_generation",
        ),
        (
            pc.QueueDeclare("r", {"qpid.max_count": -1}),
            Reason.INVALID_ARGUMENT,
            "amqp:invalid-field",
            "qpid.max_count",
        ),
        (pc.SessionOpen(SB), Reason.NOT_OWNER, "amqp:not-allowed", "belongs to member 2.200"),
    ],
)
def test_refusals_name_the_thing_and_change_nothing(
    command: object, reason: Reason, condition: str, words: str
) -> None:
    st = site("q")
    apply(st, pc.SessionClose(SB), sender=B)
    before = statistics(st)
    eff = apply(st, command, sender=A)  # type: ignore[arg-type]
    assert len(eff) == 1
    refused = eff[0]
    assert isinstance(refused, Refused)
    assert (refused.reason, refused.condition, refused.sender) == (reason, condition, A)
    assert words in refused.description
    if isinstance(command, pc.Publish):
        assert refused.ref == 5
    after = statistics(st)
    assert after["refused"] == before["refused"] + 1
    assert after["cseq"] == before["cseq"] + 1
    assert (after["queues"], after["messages"]) == (before["queues"], before["messages"])


def test_queue_arguments_are_stored_as_given_and_redeclare_merges() -> None:
    st = site()
    args: dict[str, Value] = {
        "qpid.replicate": "all",
        "qpid.queue_event_generation": 2,
        "x": b"\x00",
    }
    apply(st, pc.QueueDeclare("q", args))
    assert queue_args(st, "q") == args
    assert apply(st, pc.QueueDeclare("q")) == []  # no args: nothing changes
    eff = apply(st, pc.QueueDeclare("q", {"qpid.replicate": "configuration"}))
    assert queue_args(st, "q") == {**args, "qpid.replicate": "configuration"}
    assert len(eff) == 1
    assert eff[0].created is False  # type: ignore[union-attr]


def publish_with(st: SiteState, queue: str, **properties: Value) -> None:
    ref = st.cseq + 1
    body = Message(body=f"m{ref}", properties=properties, priority=7).encode()
    eff = apply(st, pc.Publish("", queue, body, f"id-{ref}", properties, ref), sender=A)
    assert isinstance(eff[-1], Settled), eff


def test_acquire_matching_takes_only_what_the_selector_selects_and_leaves_the_rest() -> None:
    st = site("q")
    for color in ("blue", "red", "blue", "red"):
        publish_with(st, "q", color=color)
    publish_with(st, "q")  # no color: NULL, selected by neither
    eff = apply(st, pc.AcquireMatching("q", SA, 7, 5, "color = 'red'"))
    assert [(e.consumer, e.message.properties) for e in eff] == [  # type: ignore[union-attr]
        (7, {"color": "red"}),
        (7, {"color": "red"}),
    ]
    # The blue ones and the one without a color stay, in order, for others.
    eff = apply(st, pc.Acquire("q", SB, 1, 3))
    assert [e.message.properties for e in eff] == [{"color": "blue"}, {"color": "blue"}, None]  # type: ignore[union-attr]
    # Released, a red one is selected again, in its place.
    apply(st, pc.Release("q", SA, (2,)))
    eff = apply(st, pc.AcquireMatching("q", SA, 7, 5, "color IN ('red') AND JMSPriority = 7"))
    assert [e.message.pos for e in eff] == [2]  # type: ignore[union-attr]
    assert apply(st, pc.AcquireMatching("q", SA, 7, 5, "color = 'red'")) == []


def test_acquire_matching_reads_jms_header_names() -> None:
    st = site("q")
    publish_with(st, "q", n=1)
    publish_with(st, "q", n=2)
    eff = apply(st, pc.AcquireMatching("q", SA, 1, 5, "JMSMessageID = 'id-2' AND n = 1"))
    assert eff == []
    eff = apply(st, pc.AcquireMatching("q", SA, 1, 5, "JMSMessageID LIKE 'id-%' AND n = 2"))
    assert [e.message.message_id for e in eff] == [messages(st, "q")[1].message_id]  # type: ignore[union-attr]
    eff = apply(st, pc.AcquireMatching("q", SA, 1, 5, "JMSDeliveryMode = 'NON_PERSISTENT'"))
    assert len(eff) == 1


def test_acquire_matching_reads_expiration_reply_to_and_destination() -> None:
    st = site("q")
    headers = {"expiry_time": 1_800_000_000.5, "reply_to": "replies", "address": "q"}
    for ref, fields in ((1, headers), (2, {})):
        body = Message(body=f"m{ref}", **fields).encode()
        apply(st, pc.Publish("", "q", body, f"id-{ref}", None, ref), sender=A)
    selector = "JMSExpiration = 1800000000500 AND JMSReplyTo = 'replies' AND JMSDestination = 'q'"
    eff = apply(st, pc.AcquireMatching("q", SA, 1, 5, selector))
    assert [e.message.message_id for e in eff] == ["id-1"]  # type: ignore[union-attr]
    # JMS reads a message without an expiry as JMSExpiration 0.
    eff = apply(st, pc.AcquireMatching("q", SA, 1, 5, "JMSExpiration = 0 AND JMSReplyTo IS NULL"))
    assert [e.message.message_id for e in eff] == ["id-2"]  # type: ignore[union-attr]


def test_acquire_matching_with_a_malformed_selector_is_refused_at_every_member() -> None:
    st = site("q")
    publish(st, "q", b"1")
    eff = apply(st, pc.AcquireMatching("q", SA, 1, 5, "color = "), sender=A)
    assert [(e.reason, e.condition) for e in eff] == [  # type: ignore[union-attr]
        (Reason.INVALID_ARGUMENT, "amqp:invalid-field")
    ]
    assert "selector 'color = ': at position 9" in eff[0].description  # type: ignore[union-attr]
    assert [e.message.pos for e in apply(st, pc.Acquire("q", SB, 1, 5))] == [1]  # type: ignore[union-attr]


def test_acquire_takes_first_available_in_fifo_order() -> None:
    st = site("q")
    publish(st, "q", b"1", b"2", b"3", b"4", b"5")
    eff = apply(st, pc.Acquire("q", SA, consumer=7, count=2))
    assert [(e.session, e.consumer, e.message.pos) for e in eff] == [(SA, 7, 1), (SA, 7, 2)]  # type: ignore[union-attr]
    eff = apply(st, pc.Acquire("q", SB, consumer=1, count=2))
    assert [e.message.body for e in eff] == [b"3", b"4"]  # type: ignore[union-attr]
    # Releasing pos 1 puts it back in place, ahead of pos 5, redelivered.
    eff = apply(st, pc.Release("q", SA, (1,)))
    assert eff == [Released("q", SA, (1,), "release")]
    eff = apply(st, pc.Acquire("q", SB, consumer=1, count=5))
    assert [(e.message.pos, e.message.redelivered) for e in eff] == [(1, True), (5, False)]  # type: ignore[union-attr]
    assert apply(st, pc.Acquire("q", SB, count=1)) == []
    q = list_queues(st)[0]
    assert (q.depth, q.acquired) == (5, 5)
    assert session_holdings(st, SB) == {"q": (3, 4, 1, 5)}


def test_release_without_redelivered_flag_and_stale_positions() -> None:
    st = site("q")
    publish(st, "q", b"1", b"2")
    apply(st, pc.Acquire("q", SA, count=2))
    eff = apply(st, pc.Release("q", SA, (2, 99), redelivered=False))
    assert eff == [Released("q", SA, (2,), "release")]
    assert [m.redelivered for m in messages(st, "q")] == [False, False]
    assert statistics(st)["stale_settlements"] == 1
    # Another session cannot settle what SA holds.
    assert apply(st, pc.Accept("q", SB, (1,))) == []
    assert bodies(st, "q") == [b"1", b"2"]


def test_accept_removes_only_held_messages() -> None:
    st = site("q")
    publish(st, "q", b"1", b"2", b"3")
    apply(st, pc.Acquire("q", SA, count=2))
    eff = apply(st, pc.Accept("q", SA, (2, 3)))
    assert eff == [Dequeued("q", (2,), "accept")]
    assert bodies(st, "q") == [b"1", b"3"]
    assert apply(st, pc.Accept("q", SA, (1,))) == [Dequeued("q", (1,), "accept")]
    assert session_holdings(st, SA) == {}


def test_session_close_releases_everything_it_held() -> None:
    st = site("q1", "q2")
    publish(st, "q1", b"a", b"b")
    publish(st, "q2", b"c")
    apply(st, pc.Acquire("q2", SA, count=1))
    apply(st, pc.Acquire("q1", SA, count=2))
    eff = apply(st, pc.SessionClose(SA))
    assert eff == [
        Released("q2", SA, (1,), "session_close"),
        Released("q1", SA, (1, 2), "session_close"),
    ]
    assert all(m.redelivered for q in ("q1", "q2") for m in messages(st, q))
    eff = apply(st, pc.Acquire("q1", SA))
    assert isinstance(eff[0], Refused)


def test_members_left_releases_their_sessions_and_readiness() -> None:
    st = site("q")
    apply(st, pc.MemberReady(Role.BROKER, 2, 200))
    apply(st, pc.MemberReady(Role.SIDECAR, 1, 100))
    publish(st, "q", b"a", b"b", b"c")
    apply(st, pc.Acquire("q", SA, count=1))
    apply(st, pc.Acquire("q", SB, count=1))
    cseq = st.cseq
    eff = members_left(st, [B])
    assert eff == [Released("q", SB, (2,), "member_left")]
    assert st.cseq == cseq  # a view change takes no cseq
    assert ready_members(st) == [(1, 100, Role.SIDECAR)]
    assert SB not in st.sessions
    eff = apply(st, pc.Acquire("q", SA, count=5))
    assert [e.message.pos for e in eff] == [2, 3]  # type: ignore[union-attr]


def test_purge_removes_available_messages_only() -> None:
    st = site("q")
    publish(st, "q", b"1", b"2", b"3")
    apply(st, pc.Acquire("q", SA, count=1))
    eff = apply(st, pc.Purge("q"))
    assert eff == [Dequeued("q", (2, 3), "purge")]
    assert bodies(st, "q") == [b"1"]
    apply(st, pc.Release("q", SA, (1,)))
    assert [e.message.pos for e in apply(st, pc.Acquire("q", SB, count=1))] == [1]  # type: ignore[union-attr]
    publish(st, "q", b"4")
    assert messages(st, "q")[-1].pos == 4  # positions are never reused


def test_delete_queue_drops_bindings_and_holdings() -> None:
    st = site("q")
    apply(st, pc.Bind("amq.fanout", "q"))
    publish(st, "q", b"1", b"2")
    apply(st, pc.Acquire("q", SA, count=1))
    assert apply(st, pc.QueueDelete("q")) == [QueueDeleted("q", 2)]
    assert route(st, "amq.fanout", "") == []
    assert session_holdings(st, SA) == {}
    assert apply(st, pc.SessionClose(SA)) == []
    apply(st, pc.QueueDeclare("q"))
    publish(st, "q", b"new")
    assert messages(st, "q")[0].pos == 1  # a new queue numbers from 1


def test_exchange_declare_delete_and_bindings() -> None:
    st = site("q")
    apply(st, pc.ExchangeDeclare("ex", pc.ExchangeType.TOPIC, {"a": 1}))
    apply(st, pc.Bind("ex", "q", "x.#"))
    assert route(st, "ex", "x.y") == ["q"]
    assert apply(st, pc.ExchangeDeclare("ex", pc.ExchangeType.TOPIC)) == []  # idempotent
    apply(st, pc.ExchangeDelete("ex"))
    assert route(st, "ex", "x.y") == []
    assert isinstance(apply(st, pc.Publish("ex", "x.y", b"")), list)


@pytest.mark.parametrize(
    ("args", "bodies_in", "refused_at"),
    [
        ({"qpid.max_count": 2}, [b"a", b"b", b"c"], 2),
        ({"max_depth": 1}, [b"a", b"b"], 1),
        ({"qpid.max_count": "2"}, [b"a", b"b", b"c"], 2),
        ({"qpid.max_size": 5}, [b"abc", b"de", b"f"], 2),
        ({"qpid.max_count": 0}, [b"a"], 0),
    ],
)
def test_max_depth_rejects(args: dict[str, Value], bodies_in: list[bytes], refused_at: int) -> None:
    st = site()
    apply(st, pc.QueueDeclare("q", args))
    for i, body in enumerate(bodies_in):
        eff = apply(st, pc.Publish("", "q", body, ref=i + 1), sender=A)
        if i < refused_at:
            assert isinstance(eff[-1], Settled)
        else:
            assert isinstance(eff[0], Refused)
            assert eff[0].reason is Reason.MAX_DEPTH
            assert eff[0].condition == "amqp:resource-limit-exceeded"
            assert "'q' is full" in eff[0].description
            assert eff[0].ref == i + 1
    assert statistics(st)["max_depth_refused"] == len(bodies_in) - refused_at


def test_max_depth_on_one_target_refuses_the_whole_publish() -> None:
    st = site("free")
    apply(st, pc.QueueDeclare("full", {"qpid.max_count": 0}))
    apply(st, pc.Bind("amq.fanout", "free"))
    apply(st, pc.Bind("amq.fanout", "full"))
    eff = apply(st, pc.Publish("amq.fanout", "", b"x", ref=1))
    assert [type(e) for e in eff] == [Refused]
    assert bodies(st, "free") == []


def test_cseq_counts_every_command_including_refused_and_ignored() -> None:
    st = new_state()
    cmds = [
        pc.Genesis("P", 1),
        pc.Genesis("P", 2),  # ignored
        pc.QueueDelete("nope"),  # refused
        pc.StateChunk(1, 1, 1, 0, True, b""),
        pc.RulesSwitch(b"rules"),
        pc.Enqueue("q", 1),  # bare: ignored
        pc.Dequeue("q", (1,)),  # bare: ignored
        pc.SessionClose(77),  # unknown: ignored
    ]
    for i, cmd in enumerate(cmds, 1):
        apply(st, cmd)  # type: ignore[arg-type]
        assert st.cseq == i
    assert (st.incarnation, st.cluster) == (1, "P")
    assert (st.rules, st.rules_cseq) == (b"rules", 5)
    assert statistics(st)["ignored"] == 4


def test_genesis_once() -> None:
    st = new_state()
    assert apply(st, pc.Genesis("P", 0)) == [GenesisApplied("P", 0, False)]
    assert apply(st, pc.Genesis("P", 5)) == [GenesisApplied("P", 5, True)]
    assert apply(st, pc.Genesis("Q", 6)) == [GenesisApplied("Q", 6, False)]
    assert (st.cluster, st.incarnation) == ("P", 5)


def test_apply_refuses_non_commands() -> None:
    with pytest.raises(TypeError, match="not a bus command"):
        apply(new_state(), "nope")  # type: ignore[arg-type]


def test_full_replica_heap_stays_bounded_under_dequeues() -> None:
    # Dequeues of available messages leave stale heap entries; they are compacted.
    st = site("q")
    publish(st, "q", *[b"x"] * 5000)
    q = st.queues["q"]
    for pos in range(1, 5001):
        q.remove(pos)
    assert len(q.available) < 2100
    publish(st, "q", b"y")
    eff = apply(st, pc.Acquire("q", SA, count=10))
    assert [e.message.body for e in eff] == [b"y"]  # type: ignore[union-attr]


def test_delivered_carries_message_fields() -> None:
    st = site("q")
    apply(st, pc.Publish("", "q", b"body", "mid-1", {"subject": "s", "n": 3}, ref=1))
    eff = apply(st, pc.Acquire("q", SB, consumer=4))
    assert eff == [Delivered("q", SB, 4, messages(st, "q")[0])]
    m = eff[0].message  # type: ignore[union-attr]
    assert (m.body, m.message_id, m.properties) == (b"body", "mid-1", {"subject": "s", "n": 3})


def test_modify_counts_failed_deliveries_keeps_the_message_from_the_refusing_link() -> None:
    st = site("q")
    publish(st, "q", b"1", b"2")
    apply(st, pc.Acquire("q", SA, consumer=7, count=1))
    eff = apply(st, pc.Modify("q", SA, 7, (1,), delivery_failed=True, undeliverable_here=True))
    assert eff == [Released("q", SA, (1,), "release")]
    # Consumer 7 of SA passes over pos 1; consumer 8 of the same session does not.
    assert [e.message.pos for e in apply(st, pc.Acquire("q", SA, consumer=7, count=5))] == [2]  # type: ignore[union-attr]
    assert [e.message.pos for e in apply(st, pc.Acquire("q", SA, consumer=8, count=5))] == [1]  # type: ignore[union-attr]
    apply(st, pc.Modify("q", SA, 8, (1,), delivery_failed=True))
    apply(st, pc.Release("q", SA, (2,), redelivered=True))
    assert [(m.pos, m.delivery_count, m.refused) for m in messages(st, "q")] == [
        (1, 2, ((SA, 7),)),
        (2, 1, ()),
    ]


def test_modify_merges_its_annotations_over_earlier_ones() -> None:
    st = site("q")
    publish(st, "q", b"1")
    apply(st, pc.Acquire("q", SA, consumer=1, count=1))
    apply(st, pc.Modify("q", SA, 1, (1,), annotations=b"\xc1\x06\x02\xa3\x01a\x52\x01"))
    apply(st, pc.Acquire("q", SA, consumer=1, count=1))
    apply(st, pc.Modify("q", SA, 1, (1,), annotations=b"\xc1\x06\x02\xa3\x01a\x52\x02"))
    (msg,) = messages(st, "q")
    assert (msg.delivery_count, msg.annotations) == (0, b"\xc1\x06\x02\xa3\x01a\x52\x02")
    # Damaged annotations change nothing, at every member alike.
    apply(st, pc.Acquire("q", SA, consumer=1, count=1))
    apply(st, pc.Modify("q", SA, 1, (1,), annotations=b"\xc1\x09"))
    assert messages(st, "q")[0].annotations == b"\xc1\x06\x02\xa3\x01a\x52\x02"


# --------------------------------------------------------------------------
# Temporary queues (dynamic nodes): issue 24
# --------------------------------------------------------------------------


def temporary(session: int) -> dict[str, Value]:
    return {TEMPORARY_ARG: f"{session:#x}", "qpid.replicate": "none"}


def test_a_temporary_queue_is_deleted_when_its_session_closes() -> None:
    st = site("keep")
    assert apply(st, pc.QueueDeclare("tmp-a", temporary(SA)), sender=A)[0].created  # type: ignore[union-attr]
    apply(st, pc.QueueDeclare("tmp-b", temporary(SB)), sender=B)
    publish(st, "tmp-a", b"reply")
    apply(st, pc.Acquire("tmp-a", SB, 1, 1))  # another session holds its message
    eff = apply(st, pc.SessionClose(SA), sender=A)
    assert [e for e in eff if isinstance(e, QueueDeleted)] == [QueueDeleted("tmp-a", 1)]
    assert sorted(st.queues) == ["keep", "tmp-b"]
    assert session_holdings(st, SB) == {}
    # Closing the session again deletes nothing more.
    assert apply(st, pc.SessionClose(SA), sender=A) == []


def test_a_temporary_queue_is_deleted_when_its_member_leaves_the_view() -> None:
    st = site()
    apply(st, pc.QueueDeclare("tmp-b", temporary(SB)), sender=B)
    eff = members_left(st, [B])
    assert QueueDeleted("tmp-b", 0) in eff
    assert "tmp-b" not in st.queues


def test_a_temporary_queue_needs_an_open_session_of_its_sender_and_a_new_name() -> None:
    st = site("q")
    closed = session_id(1, 100, 9)
    for cmd, text in [
        (pc.QueueDeclare("t", temporary(closed)), "session 0x10000640009 is not open"),
        (pc.QueueDeclare("t", temporary(SB)), "belongs to member 2.200, not to the sender 1.100"),
        (pc.QueueDeclare("t", {TEMPORARY_ARG: "x"}), "not a session id"),
        (pc.QueueDeclare("q", temporary(SA)), "queue 'q' exists"),
    ]:
        (refused,) = apply(st, cmd, sender=A)
        assert isinstance(refused, Refused), refused
        assert (refused.reason, refused.condition) == (
            Reason.INVALID_ARGUMENT,
            "amqp:invalid-field",
        )
        assert text in refused.description
    assert sorted(st.queues) == ["q"]
    assert TEMPORARY_ARG not in st.queues["q"].args


def test_queue_scans_for_selectors_and_browsers_pass_each_position_once() -> None:
    st = site("q")
    for color in ("blue", "red", "blue", "red", "blue"):
        publish_with(st, "q", color=color)
    q = st.queues["q"]

    def red(msg: StoredMessage) -> bool:
        return bool(msg.properties and msg.properties.get("color") == "red")

    # Two red ones (2 and 4); nothing selected at or below 1.
    assert q.count_matching(0, 5, red) == (2, 1)
    assert q.count_matching(0, 1, red) == (1, 1)
    apply(st, pc.AcquireMatching("q", SA, 1, 5, "color = 'red'"))
    # Both acquired: nothing left up to the last position.
    assert q.count_matching(1, 5, red) == (0, 5)
    apply(st, pc.Acquire("q", SB, 1, 1))  # takes 1, a blue one
    apply(st, pc.Accept("q", SB, (1,)))
    # A browser walks every message once, acquired or not.
    assert [m.pos for m in q.browse(0, 2)[0]] == [2, 3]
    assert q.browse(0, 2)[1] == 3
    assert [m.pos for m in q.browse(3, 10)[0]] == [4, 5]
    assert q.browse(3, 10)[1] == 5
    assert q.browse(0, 10, red)[0] == [q.messages[2], q.messages[4]]
