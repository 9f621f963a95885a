"""cluster.state: the merge rules R1-R7 at D (docs/architecture.md, section 6), table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.state import (
    Conflict,
    Dequeued,
    Effect,
    Enqueued,
    IncarnationAccepted,
    Outcome,
    Promoted,
    QueueDeclared,
    Reason,
    Refused,
    ReplicatedOutcome,
    Settled,
    SiteState,
    applied,
    apply,
    list_queues,
    messages,
    origin_info,
    queue_digest,
    queue_info,
    replica_mode,
    route,
    session_id,
    statistics,
)
from protocol import cluster as pc
from protocol.modes import Mode
from tests.support.state import Member, genesis_state

CLIENT = Member(1, 10)
SID = session_id(1, 10, 1)
INC = 7


class Feed:
    """Builds Replicated commands from site P with increasing origin cseq."""

    def __init__(self, origin: str = "P", incarnation: int = INC, epoch: int = 1) -> None:
        self.origin = origin
        self.incarnation = incarnation
        self.epoch = epoch
        self.cseq = 0

    def rep(self, *pairs: tuple[Mode, pc.Command], cseq: int | None = None) -> pc.Replicated:
        if cseq is None:
            self.cseq += 1
            cseq = self.cseq
        return pc.Replicated(
            self.origin,
            self.incarnation,
            cseq,
            self.epoch,
            1_000_000 + cseq,
            tuple(m for m, _ in pairs),
            tuple(c for _, c in pairs),
        )


def d_site() -> SiteState:
    st = genesis_state("D", 99)
    apply(st, pc.SessionOpen(SID), sender=CLIENT)
    return st


def outcome(eff: list[Effect]) -> Outcome:
    outs = [e for e in eff if isinstance(e, ReplicatedOutcome)]
    assert len(outs) == 1, eff
    return outs[0].outcome


def with_replicas(feed: Feed, *queues: tuple[str, Mode]) -> SiteState:
    st = d_site()
    for name, mode in queues:
        assert outcome(apply(st, feed.rep((mode, pc.QueueDeclare(name, {"m": mode.label}))))) is (
            Outcome.APPLIED
        )
    return st


def enq(name: str, pos: int, body: bytes | None = None) -> pc.Enqueue:
    return pc.Enqueue(name, pos, body if body is not None else f"{name}{pos}".encode())


# --------------------------------------------------------------------------
# R1 dedup
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cseqs", "outcomes"),
    [
        ([1, 2, 3], "AAA"),
        ([1, 1], "AD"),
        ([1, 2, 2, 1, 3], "AADDA"),
        ([5, 3, 6], "ADA"),  # gaps are the link's business; below the mark is a duplicate
        ([10, 10, 10, 11], "ADDA"),
    ],
)
def test_r1_dedup_by_applied_watermark(cseqs: list[int], outcomes: str) -> None:
    feed = Feed()
    st = with_replicas(Feed(), ("q", Mode.FULL))  # declared at origin cseq 1 by its own feed
    st.origins["P"].applied[INC] = 0  # start the table from a clean watermark
    expected = {"A": Outcome.APPLIED, "D": Outcome.DUPLICATE}
    for i, (cseq, code) in enumerate(zip(cseqs, outcomes, strict=True)):
        eff = apply(st, feed.rep((Mode.FULL, enq("q", 100 + i)), cseq=cseq))
        assert outcome(eff) is expected[code], (i, cseq)
        # A duplicate changes nothing but the counter.
        assert (code == "A") == any(isinstance(e, Enqueued) for e in eff)
    assert statistics(st)["r1_duplicates"] == outcomes.count("D")
    assert applied(st, "P", INC) == max(cseqs)


def test_r1_watermarks_are_per_incarnation() -> None:
    old = Feed(incarnation=1)
    st = with_replicas(old, ("q", Mode.ENQUEUE))
    for _ in range(5):
        apply(st, old.rep((Mode.ENQUEUE, enq("q", old.cseq + 1))))
    new = Feed(incarnation=2)  # P restarted from nothing: small cseqs again
    eff = apply(st, new.rep((Mode.ENQUEUE, enq("q", 1))))
    assert outcome(eff) is Outcome.INCARNATION
    assert origin_info(st, "P").refused_incarnation == 2  # type: ignore[union-attr]
    assert len(messages(st, "q")) == 5  # replicas never wiped
    assert apply(st, pc.AcceptIncarnation("P", 2)) == [IncarnationAccepted("P", 2)]
    new.cseq = 0
    eff = apply(st, new.rep((Mode.ENQUEUE, pc.QueueDeclare("q2"))))
    assert outcome(eff) is Outcome.APPLIED  # cseq 1 of the new incarnation: not a duplicate
    assert applied(st, "P", 1) == 6
    assert applied(st, "P", 2) == 1
    assert statistics(st)["incarnation_refused"] == 1
    # The old incarnation is no longer accepted.
    assert outcome(apply(st, old.rep((Mode.ENQUEUE, enq("q", 99))))) is Outcome.INCARNATION


# --------------------------------------------------------------------------
# R2 order
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [Mode.FULL, Mode.ENQUEUE])
def test_r2_per_queue_order_is_origin_order(mode: Mode) -> None:
    feed = Feed()
    st = with_replicas(feed, ("a", mode), ("b", mode))
    # Origin positions as P assigned them, interleaved across queues, in P's order.
    stream = [("a", 1), ("b", 1), ("a", 2), ("a", 3), ("b", 2), ("b", 3), ("a", 4)]
    for i in range(0, len(stream), 2):
        chunk = stream[i : i + 2]
        apply(st, feed.rep(*[(mode, enq(q, p)) for q, p in chunk]))
    for q in ("a", "b"):
        assert [m.origin_pos for m in messages(st, q)] == [p for n, p in stream if n == q]
        assert [m.body for m in messages(st, q)] == [
            f"{q}{p}".encode() for n, p in stream if n == q
        ]


def test_r2_order_kept_when_local_publishes_interleave_on_an_enqueue_queue() -> None:
    feed = Feed()
    st = with_replicas(feed, ("q", Mode.ENQUEUE))
    apply(st, feed.rep((Mode.ENQUEUE, enq("q", 1, b"r1"))))
    apply(st, pc.Publish("", "q", b"l1", ref=1), sender=CLIENT)
    apply(st, feed.rep((Mode.ENQUEUE, enq("q", 2, b"r2"))))
    apply(st, pc.Publish("", "q", b"l2", ref=2), sender=CLIENT)
    assert [m.body for m in messages(st, "q")] == [b"r1", b"l1", b"r2", b"l2"]
    assert [m.pos for m in messages(st, "q")] == [1, 2, 3, 4]


# --------------------------------------------------------------------------
# R3 read-only full replicas
# --------------------------------------------------------------------------


LOCAL_WRITES: list[tuple[str, pc.Command]] = [
    ("publish", pc.Publish("", "q", b"x", ref=4)),
    ("acquire", pc.Acquire("q", SID, 1, 1)),
    ("purge", pc.Purge("q")),
    ("delete", pc.QueueDelete("q")),
]


@pytest.mark.parametrize(("what", "command"), LOCAL_WRITES, ids=[w for w, _ in LOCAL_WRITES])
@pytest.mark.parametrize(
    ("mode", "refused"),
    [(Mode.FULL, True), (Mode.ENQUEUE, False), (Mode.WIRING, False)],
)
def test_r3_full_replicas_are_read_only_to_local_clients(
    what: str, command: pc.Command, mode: Mode, refused: bool
) -> None:
    feed = Feed()
    st = with_replicas(feed, ("q", mode))
    apply(st, feed.rep((mode, enq("q", 1))))
    eff = apply(st, command, sender=CLIENT)
    is_refused = bool(eff) and isinstance(eff[0], Refused)
    assert is_refused is refused, eff
    if refused:
        r = eff[0]
        assert isinstance(r, Refused)
        assert (r.reason, r.condition, r.name, r.sender) == (
            Reason.READ_ONLY,
            "amqp:not-allowed",
            "q",
            CLIENT,
        )
        assert "'q'" in r.description
        assert "read-only replica of site 'P'" in r.description
        assert "promote" in r.description
        assert statistics(st)["r3_refused"] == 1
        assert queue_info(st, "q").writable is False  # type: ignore[union-attr]


def test_r3_publish_through_fanout_touching_a_full_replica_is_refused_whole() -> None:
    feed = Feed()
    st = with_replicas(feed, ("mirror", Mode.FULL))
    apply(st, pc.QueueDeclare("local"))
    apply(st, pc.Bind("amq.fanout", "local"))
    apply(st, pc.Bind("amq.fanout", "mirror"))
    eff = apply(st, pc.Publish("amq.fanout", "", b"x", ref=1), sender=CLIENT)
    assert [type(e) for e in eff] == [Refused]
    assert messages(st, "local") == ()


def test_r3_promotion_makes_full_replicas_writable() -> None:
    feed = Feed()
    st = with_replicas(feed, ("q", Mode.FULL))
    apply(st, feed.rep((Mode.FULL, enq("q", 1))))
    assert apply(st, pc.Promote("P", 2, 5)) == [Promoted("P", 2)]
    assert queue_info(st, "q").writable is True  # type: ignore[union-attr]
    eff = apply(st, pc.Publish("", "q", b"local", ref=3), sender=CLIENT)
    assert eff == [Enqueued("q", 2), Settled(3, CLIENT, ("q",))]
    eff = apply(st, pc.Acquire("q", SID, 1, 2))
    assert [e.message.body for e in eff] == [b"q1", b"local"]  # type: ignore[union-attr]


# --------------------------------------------------------------------------
# R4 enqueue queues
# --------------------------------------------------------------------------


def test_r4_enqueue_queue_appends_remote_at_tail_and_never_applies_remote_dequeues() -> None:
    feed = Feed()
    st = with_replicas(feed, ("q", Mode.ENQUEUE))
    apply(st, pc.Publish("", "q", b"local", ref=1), sender=CLIENT)
    eff = apply(st, feed.rep((Mode.ENQUEUE, enq("q", 10, b"remote"))))
    assert Enqueued("q", 2, 10) in eff  # local pos 2, origin pos 10
    # D's own consumer takes both.
    got = apply(st, pc.Acquire("q", SID, 1, 5))
    assert [e.message.body for e in got] == [b"local", b"remote"]  # type: ignore[union-attr]
    # P's consumers took pos 10 at P: not applied here.
    eff = apply(st, feed.rep((Mode.FULL, pc.Dequeue("q", (10,)))))
    assert outcome(eff) is Outcome.APPLIED
    assert not any(isinstance(e, Dequeued) for e in eff)
    assert len(messages(st, "q")) == 2
    assert statistics(st)["r4_dequeues_ignored"] == 1
    assert apply(st, feed.rep((Mode.ENQUEUE, pc.Purge("q")))) != []
    assert len(messages(st, "q")) == 2
    assert queue_info(st, "q").high_pos == 10  # type: ignore[union-attr]


# --------------------------------------------------------------------------
# R5 remote dequeue of a message D does not hold
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("held", "dequeued", "removed", "conflicts"),
    [
        ([1, 2, 3], [1], [1], 0),
        ([1, 2, 3], [4], [], 1),
        ([1, 2, 3], [2, 9, 3], [2, 3], 1),
        ([], [1, 2], [], 2),
        ([1], [1, 1], [1], 1),  # the second is no longer held
    ],
)
def test_r5_remote_dequeue_of_missing_message_is_a_counted_noop(
    held: list[int], dequeued: list[int], removed: list[int], conflicts: int
) -> None:
    feed = Feed()
    st = with_replicas(feed, ("q", Mode.FULL))
    for p in held:
        apply(st, feed.rep((Mode.FULL, enq("q", p))))
    eff = apply(st, feed.rep((Mode.FULL, pc.Dequeue("q", tuple(dequeued)))))
    assert [e for e in eff if isinstance(e, Dequeued)] == (
        [Dequeued("q", tuple(removed), "dequeue")] if removed else []
    )
    assert [m.pos for m in messages(st, "q")] == [p for p in held if p not in removed]
    assert statistics(st)["r5_conflicts"] == conflicts


# --------------------------------------------------------------------------
# R6 remote declare of a local name
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local", "remote", "conflict"),
    [
        (pc.QueueDeclare("q", {"x": 1}), pc.QueueDeclare("q", {"x": 1}), True),
        (pc.QueueDeclare("q"), pc.QueueDelete("q"), True),
        (
            pc.ExchangeDeclare("e", pc.ExchangeType.FANOUT),
            pc.ExchangeDeclare("e", pc.ExchangeType.TOPIC),
            True,
        ),
        (pc.ExchangeDeclare("e", pc.ExchangeType.FANOUT), pc.ExchangeDelete("e"), True),
        (
            pc.ExchangeDeclare("e", pc.ExchangeType.FANOUT),
            pc.ExchangeDeclare("e", pc.ExchangeType.FANOUT),
            False,
        ),
        (None, pc.ExchangeDeclare("amq.topic", pc.ExchangeType.TOPIC), False),
        (None, pc.ExchangeDelete("amq.topic"), True),
    ],
)
def test_r6_remote_declare_of_a_local_name_is_not_applied(
    local: pc.Command | None, remote: pc.Command, conflict: bool
) -> None:
    feed = Feed()
    st = d_site()
    if local is not None:
        apply(st, local)
    before = (list_queues(st), [(e, route(st, e, "k")) for e in st.exchanges])
    exchanges_before = {n: (x.type, dict(x.args)) for n, x in st.exchanges.items()}
    for attempt in range(3):
        eff = apply(st, feed.rep((Mode.WIRING, remote)))
        assert outcome(eff) is Outcome.APPLIED
        conflicts = [e for e in eff if isinstance(e, Conflict)]
        # Reported once, counted every time.
        assert len(conflicts) == (1 if conflict and attempt == 0 else 0)
        if conflicts:
            c = conflicts[0]
            assert (c.rule, c.origin_cluster, c.name) == ("R6", "P", remote.key)
            assert c.local and c.remote and c.local != c.remote
            assert repr(remote.key) in c.description
    assert statistics(st)["r6_conflicts"] == (3 if conflict else 0)
    assert list_queues(st) == before[0]
    assert {n: (x.type, dict(x.args)) for n, x in st.exchanges.items()} == exchanges_before


def test_r6_conflict_reported_again_after_the_local_queue_is_deleted() -> None:
    feed = Feed()
    st = d_site()
    apply(st, pc.QueueDeclare("q"))
    eff = apply(st, feed.rep((Mode.FULL, pc.QueueDeclare("q"))))
    assert any(isinstance(e, Conflict) for e in eff)
    apply(st, pc.QueueDelete("q"))
    eff = apply(st, feed.rep((Mode.FULL, pc.QueueDeclare("q"))))
    assert not any(isinstance(e, Conflict) for e in eff)
    assert replica_mode(st, "q") is Mode.FULL
    apply(st, pc.Promote("P", 5, 0))
    apply(st, pc.QueueDelete("q"))
    apply(st, pc.QueueDeclare("q"))
    apply(st, pc.AcceptPrimary("P", 6))
    eff = apply(st, Feed(epoch=6).rep((Mode.FULL, pc.QueueDeclare("q")), cseq=100))
    assert any(isinstance(e, Conflict) for e in eff)


def test_remote_redeclare_of_own_replica_changes_its_mode() -> None:
    feed = Feed()
    st = with_replicas(feed, ("q", Mode.ENQUEUE))
    eff = apply(st, feed.rep((Mode.FULL, pc.QueueDeclare("q", {"qpid.replicate": "all"}))))
    assert QueueDeclared("q", False, {"qpid.replicate": "all"}, Mode.FULL) in eff
    assert replica_mode(st, "q") is Mode.FULL


def test_remote_wiring_bindings_and_deletes() -> None:
    feed = Feed()
    st = with_replicas(feed, ("q", Mode.WIRING))
    apply(st, feed.rep((Mode.WIRING, pc.ExchangeDeclare("ex", pc.ExchangeType.DIRECT))))
    apply(st, feed.rep((Mode.WIRING, pc.Bind("ex", "q", "k"))))
    assert route(st, "ex", "k") == ["q"]
    eff = apply(st, feed.rep((Mode.WIRING, enq("q", 1))))
    assert not any(isinstance(e, Enqueued) for e in eff)  # wiring carries no messages
    apply(st, feed.rep((Mode.WIRING, pc.Unbind("ex", "q", "k"))))
    assert route(st, "ex", "k") == []
    apply(st, feed.rep((Mode.WIRING, pc.QueueDelete("q")), (Mode.WIRING, pc.ExchangeDelete("ex"))))
    assert "q" not in st.queues
    assert "ex" not in st.exchanges


# --------------------------------------------------------------------------
# R7 fencing, promotion
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        # (epoch of a Replicated, or ("promote", epoch)) -> outcome / Promoted / ignored
        # The replicas were declared at epoch 1: that is the accepted epoch.
        ([1, 1, 2, 1], "AAFA"),  # a higher epoch from a link peer moves nothing
        ([3, 2], "FF"),
        ([1, ("promote", 2), 1, 2], "APFF"),
        ([1, ("promote", 2), 3, 2], "APFF"),  # no epoch un-promotes: AcceptPrimary does
        ([1, ("promote", 2), ("promote", 2), ("promote", 1)], "APII"),
        ([("promote", 4), 4, 5], "PFF"),
    ],
)
def test_r7_epoch_fencing(steps: list[Any], expected: str) -> None:
    st = with_replicas(Feed(), ("q", Mode.FULL))
    cseq = 10
    fenced = 0
    for step, code in zip(steps, expected, strict=True):
        if isinstance(step, tuple):
            eff = apply(st, pc.Promote("P", step[1], 123))
            if code == "P":
                assert eff == [Promoted("P", step[1])]
            else:
                assert eff == []
            continue
        cseq += 1
        eff = apply(st, Feed(epoch=step).rep((Mode.FULL, enq("q", cseq)), cseq=cseq))
        want = Outcome.APPLIED if code == "A" else Outcome.FENCED
        assert outcome(eff) is want, (step, eff)
        fenced += code == "F"
    assert statistics(st)["r7_fenced"] == fenced


def test_r7_only_the_operator_lets_the_primary_in_again_after_a_promotion() -> None:
    st = with_replicas(Feed(), ("q", Mode.FULL))
    apply(st, Feed().rep((Mode.FULL, enq("q", 1)), cseq=20))
    apply(st, pc.Promote("P", 2, 0))
    assert queue_info(st, "q").writable is True  # type: ignore[union-attr]
    # A link peer claiming a higher epoch used to end the promotion.
    eff = apply(st, Feed(epoch=3).rep((Mode.FULL, enq("q", 2)), cseq=50))
    assert outcome(eff) is Outcome.FENCED
    info = origin_info(st, "P")
    assert info is not None and (info.epoch, info.promoted) == (2, True)
    assert queue_info(st, "q").writable is True  # type: ignore[union-attr]
    apply(st, pc.AcceptPrimary("P", 2))  # not above the promotion: ignored
    assert origin_info(st, "P").promoted  # type: ignore[union-attr]
    apply(st, pc.AcceptPrimary("P", 3))
    info = origin_info(st, "P")
    assert info is not None
    assert (info.epoch, info.promoted, info.applied) == (3, False, {INC: 0})
    assert queue_info(st, "q").writable is False  # type: ignore[union-attr]
    assert outcome(apply(st, Feed(epoch=2).rep((Mode.FULL, enq("q", 3)), cseq=51))) is (
        Outcome.FENCED
    )
    eff = apply(st, Feed(epoch=3).rep((Mode.FULL, enq("q", 3)), cseq=51))
    assert outcome(eff) is Outcome.APPLIED


def test_replicated_from_this_very_site_is_refused() -> None:
    st = d_site()
    eff = apply(st, Feed(origin="D").rep((Mode.FULL, pc.QueueDeclare("q"))))
    assert outcome(eff) is Outcome.OWN_ORIGIN
    assert "q" not in st.queues


def test_origin_tracking_for_rpo_and_resync() -> None:
    feed = Feed()
    st = with_replicas(feed, ("q", Mode.FULL), ("e", Mode.ENQUEUE))
    apply(st, feed.rep((Mode.FULL, enq("q", 4)), (Mode.ENQUEUE, enq("e", 9))))
    info = origin_info(st, "P")
    assert info is not None
    assert (info.incarnation, info.applied, info.last_time_us) == (INC, {INC: 3}, 1_000_003)
    assert info.last_cseq == st.cseq
    assert queue_info(st, "q").high_pos == 4  # type: ignore[union-attr]
    assert queue_info(st, "e").high_pos == 9  # type: ignore[union-attr]
    # A stale enqueue (a resync overlapping the stream) is skipped, order kept.
    apply(st, feed.rep((Mode.FULL, enq("q", 3))))
    assert [m.pos for m in messages(st, "q")] == [4]
    assert statistics(st)["replicated_stale_enqueues"] == 1


def test_unsupported_inner_commands_and_missing_queues_are_counted() -> None:
    feed = Feed()
    st = d_site()
    eff = apply(
        st,
        feed.rep(
            (Mode.FULL, pc.Publish("", "q", b"x")),
            (Mode.FULL, enq("nope", 1)),
            (Mode.NONE, pc.QueueDeclare("n")),
        ),
    )
    assert outcome(eff) is Outcome.APPLIED
    stats = statistics(st)
    assert (stats["replicated_unsupported"], stats["replicated_missing_queue"]) == (2, 1)
    assert "n" not in st.queues


def test_full_replica_queue_digest_matches_origin_queue() -> None:
    p = genesis_state("P", INC)
    apply(p, pc.QueueDeclare("q"))
    apply(p, pc.SessionOpen(SID), sender=CLIENT)
    feed = Feed()
    d = with_replicas(feed, ("q", Mode.FULL))
    for i in range(5):
        eff = apply(p, pc.Publish("", "q", f"m{i}".encode(), f"id{i}", {"k": i}, ref=i))
        pos = next(e.pos for e in eff if isinstance(e, Enqueued))
        apply(d, feed.rep((Mode.FULL, pc.Enqueue("q", pos, f"m{i}".encode(), f"id{i}", {"k": i}))))
    got = apply(p, pc.Acquire("q", SID, 1, 2))
    assert queue_digest(p, "q") == queue_digest(d, "q")  # acquisition is not content
    eff = apply(p, pc.Accept("q", SID, tuple(e.message.pos for e in got)))  # type: ignore[union-attr]
    removed = next(e for e in eff if isinstance(e, Dequeued))
    assert queue_digest(p, "q") != queue_digest(d, "q")
    apply(d, feed.rep((Mode.FULL, pc.Dequeue("q", removed.positions))))
    assert queue_digest(p, "q") == queue_digest(d, "q")
    assert queue_digest(d, "nope") is None
