"""gateway/tap: what P forwards to D, command by command, in each mode.

Commands are applied to a real site state, then given to the tap with the
effects the state machine returned, as the sidecar does.
"""

from __future__ import annotations

import pytest

from cluster.bus.contract import MemberId
from cluster.state import SiteState, apply, new_state, session_id
from filters.rules import load_rules
from filters.switch import RulesPayload
from gateway.tap import SWITCH_EVENT_MAX_BYTES, SWITCH_EVENT_MAX_MESSAGES, ReplEvent, Tap
from protocol import cluster as pc
from protocol.modes import PAUSED_ARG, Mode

A = MemberId(1, 100)
SA = session_id(1, 100, 1)

# f.* full, e.* enqueue, w.* wiring, anything else none; D's names get "dr.".
RULES = """\
version: 1
rules:
  - {name: f, match: {queue: "f.*"}, action: {mode: full, target: {prefix: "dr."}}}
  - {name: e, match: {queue: "e.*"}, action: {mode: enqueue, target: {prefix: "dr."}}}
  - {name: w, match: {queue: "w.*"}, action: {mode: wiring, target: {prefix: "dr."}}}
  - {name: big, match: {queue: "s.*"}, action: {mode: full, max_message_bytes: 4}}
default: {mode: none}
"""
QUEUES = {"f.q": Mode.FULL, "e.q": Mode.ENQUEUE, "w.q": Mode.WIRING, "n.q": Mode.NONE}


class Site:
    """P's state and a tap over it."""

    def __init__(self, rules: str = RULES) -> None:
        self.state: SiteState = new_state()
        self.tap = Tap(load_rules(rules, "rules.yaml"), origin_cluster="site-p", epoch=3)
        self.run(pc.Genesis("site-p", 42))
        self.run(pc.SessionOpen(SA))

    def run(self, cmd: pc.Command, time_us: int = 1_000) -> ReplEvent | None:
        effects = apply(self.state, cmd, sender=A)
        return self.tap.on_command(self.state, cmd, effects, time_us)

    def forwarded(self, cmd: pc.Command) -> list[tuple[Mode, pc.Command]]:
        """The (mode, inner command) pairs of ``cmd``'s event; [] if none."""
        event = self.run(cmd)
        if event is None:
            return []
        (replicated,) = pc.decode_frame_untrusted(event.payload)
        assert isinstance(replicated, pc.Replicated)
        assert event.modes == replicated.modes
        assert event.queues == tuple(c.key for c in replicated.commands)
        return list(zip(replicated.modes, replicated.commands, strict=True))

    def switch(self, rules: str) -> list[tuple[Mode, pc.Command]]:
        return self.forwarded(pc.RulesSwitch(RulesPayload.for_text(rules, 1).to_bytes()))

    def positions(self, queue: str) -> tuple[int, ...]:
        return tuple(self.state.queues[queue].messages)


def declared(*queues: str) -> Site:
    site = Site()
    for q in queues:
        site.run(pc.QueueDeclare(q, {"x": 1}))
    return site


def test_the_event_is_one_replicated_command_at_the_commands_cseq() -> None:
    site = Site()
    event = site.run(pc.QueueDeclare("f.q"), time_us=777)
    assert event is not None
    (replicated,) = pc.decode_frame_untrusted(event.payload)
    assert isinstance(replicated, pc.Replicated)
    assert (event.seq, event.time_us) == (site.state.cseq, 777)
    assert (
        replicated.origin_cluster,
        replicated.incarnation,
        replicated.origin_cseq,
        replicated.epoch,
        replicated.origin_time_us,
    ) == ("site-p", 42, site.state.cseq, 3, 777)


def test_each_event_names_the_event_forwarded_before_it() -> None:
    site = Site()
    first = site.run(pc.QueueDeclare("f.q"))
    site.run(pc.QueueDeclare("n.q"))  # filtered: no event, and not a predecessor
    site.run(pc.QueueDeclare("n.r"))
    second = site.run(pc.QueueDeclare("e.q"))
    assert first is not None and second is not None
    assert first.prev_seq == 0  # nothing forwarded before, in this incarnation
    assert second.seq == first.seq + 3
    assert second.prev_seq == first.seq


def test_after_a_join_the_first_event_follows_the_join_point() -> None:
    # A sidecar that joins (or rejoins) at cseq J does not know what was
    # forwarded before J: its first event says J, the spool's floor.
    site = Site()
    site.run(pc.QueueDeclare("f.q"))
    site.run(pc.QueueDeclare("n.q"))
    join = site.state.cseq
    site.tap.resync_rules(site.state)
    event = site.run(pc.QueueDeclare("e.q"))
    assert event is not None
    assert (event.seq, event.prev_seq) == (join + 1, join)


@pytest.mark.parametrize(("queue", "mode"), QUEUES.items())
def test_declare_crosses_in_every_mode_but_none(queue: str, mode: Mode) -> None:
    site = Site()
    got = site.forwarded(pc.QueueDeclare(queue, {"x": 1}))
    if mode is Mode.NONE:
        assert got == []
        assert site.tap.statistics().filtered_total == {("none", "default"): 1}
    else:
        assert got == [(mode, pc.QueueDeclare(f"dr.{queue}", {"x": 1}))]


@pytest.mark.parametrize(("queue", "mode"), QUEUES.items())
def test_bind_and_unbind_cross_in_every_mode_but_none(queue: str, mode: Mode) -> None:
    site = declared(queue)
    assert site.forwarded(pc.ExchangeDeclare("ex", pc.ExchangeType.TOPIC)) == [
        (Mode.WIRING, pc.ExchangeDeclare("ex", pc.ExchangeType.TOPIC))
    ]
    bind = site.forwarded(pc.Bind("ex", queue, "a.#", {"k": "v"}))
    unbind = site.forwarded(pc.Unbind("ex", queue, "a.#"))
    if mode is Mode.NONE:
        assert (bind, unbind) == ([], [])
    else:
        assert bind == [(mode, pc.Bind("ex", f"dr.{queue}", "a.#", {"k": "v"}))]
        assert unbind == [(mode, pc.Unbind("ex", f"dr.{queue}", "a.#"))]


def test_a_refused_exchange_declare_does_not_cross() -> None:
    site = Site()
    site.run(pc.ExchangeDeclare("ex", pc.ExchangeType.TOPIC))
    assert site.forwarded(pc.ExchangeDeclare("ex", pc.ExchangeType.FANOUT)) == []
    assert site.forwarded(pc.ExchangeDelete("ex")) == [(Mode.WIRING, pc.ExchangeDelete("ex"))]


def test_a_publish_crosses_as_one_enqueue_per_routed_queue_that_forwards_messages() -> None:
    site = declared(*QUEUES)
    site.run(pc.ExchangeDeclare("fan", pc.ExchangeType.FANOUT))
    for q in QUEUES:
        site.run(pc.Bind("fan", q))
    got = site.forwarded(pc.Publish("fan", "", b"body", "m-1", {"h": "v"}, ref=1))
    assert got == [
        (Mode.FULL, pc.Enqueue("dr.f.q", 1, b"body", "m-1", {"h": "v"})),
        (Mode.ENQUEUE, pc.Enqueue("dr.e.q", 1, b"body", "m-1", {"h": "v"})),
    ]
    # A second publish carries P's next position.
    assert site.forwarded(pc.Publish("", "f.q", b"two", "m-2", ref=2)) == [
        (Mode.FULL, pc.Enqueue("dr.f.q", 2, b"two", "m-2"))
    ]


@pytest.mark.parametrize("queue", ["w.q", "n.q"])
def test_a_publish_to_a_queue_without_messages_at_d_does_not_cross(queue: str) -> None:
    site = declared(queue)
    before = sum(site.tap.statistics().filtered_total.values())
    assert site.forwarded(pc.Publish("", queue, b"body", ref=1)) == []
    assert sum(site.tap.statistics().filtered_total.values()) == before + 1


def test_a_message_over_the_rules_size_limit_is_dropped() -> None:
    site = declared("s.q")
    assert site.forwarded(pc.Publish("", "s.q", b"12345", ref=1)) == []
    assert site.tap.statistics().dropped_total == {"size": 1}
    assert site.forwarded(pc.Publish("", "s.q", b"1234", ref=2)) == [
        (Mode.FULL, pc.Enqueue("s.q", 2, b"1234"))
    ]


@pytest.mark.parametrize(("queue", "mode"), QUEUES.items())
def test_acquire_never_crosses_and_accept_crosses_as_dequeue_only_in_full(
    queue: str, mode: Mode
) -> None:
    site = declared(queue)
    for i in range(3):
        site.run(pc.Publish("", queue, b"m", ref=i))
    assert site.forwarded(pc.Acquire(queue, SA, count=2)) == []
    got = site.forwarded(pc.Accept(queue, SA, (1, 2)))
    if mode is Mode.FULL:
        assert got == [(Mode.FULL, pc.Dequeue("dr.f.q", (1, 2)))]
    else:
        assert got == []
    assert site.positions(queue) == (3,)


@pytest.mark.parametrize(("queue", "mode"), QUEUES.items())
def test_purge_crosses_as_a_dequeue_of_every_message_only_in_full(queue: str, mode: Mode) -> None:
    site = declared(queue)
    for i in range(3):
        site.run(pc.Publish("", queue, b"m", ref=i))
    got = site.forwarded(pc.Purge(queue))
    if mode is Mode.FULL:
        assert got == [(Mode.FULL, pc.Dequeue("dr.f.q", (1, 2, 3)))]
    else:
        assert got == []


@pytest.mark.parametrize(("queue", "mode"), QUEUES.items())
def test_delete_crosses_in_every_mode_but_none(queue: str, mode: Mode) -> None:
    site = declared(queue)
    got = site.forwarded(pc.QueueDelete(queue))
    if mode is Mode.NONE:
        assert got == []
    else:
        assert got == [(mode, pc.QueueDelete(f"dr.{queue}"))]
    # The decision is forgotten: a queue re-declared later is decided again.
    assert queue not in site.tap.rules.decisions


def switched(q_mode: str) -> str:
    """RULES with q.* given ``q_mode`` (and D's name "dr.")."""
    action = f'{{mode: {q_mode}, target: {{prefix: "dr."}}}}'
    rule = f'  - {{name: q, match: {{queue: "q.*"}}, action: {action}}}\n'
    head, rest = RULES.split("rules:\n")
    return f"{head}rules:\n{rule}{rest}"


def queue_with_content(site: Site) -> None:
    """q.1 holding two messages (one with properties), bound twice, plus one
    binding on the default exchange that D must not get."""
    site.run(pc.QueueDeclare("q.1", {"a": 1}))
    site.run(pc.ExchangeDeclare("ex", pc.ExchangeType.DIRECT))
    site.run(pc.Bind("ex", "q.1", "k1"))
    site.run(pc.Bind("ex", "q.1", "k2", {"b": True}))
    site.run(pc.Publish("", "q.1", b"one", "m-1", {"p": "x"}, ref=1))
    site.run(pc.Publish("ex", "k2", b"two", "m-2", ref=2))


WIRING_OF_Q1 = [
    pc.QueueDeclare("dr.q.1", {"a": 1}),
    pc.Bind("ex", "dr.q.1", "k1", {}),
    pc.Bind("ex", "dr.q.1", "k2", {"b": True}),
]
MESSAGES_OF_Q1 = [
    pc.Enqueue("dr.q.1", 1, b"one", "m-1", {"p": "x"}),
    pc.Enqueue("dr.q.1", 2, b"two", "m-2", {}),
]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("full", WIRING_OF_Q1 + MESSAGES_OF_Q1),
        ("enqueue", WIRING_OF_Q1 + MESSAGES_OF_Q1),
        ("wiring", WIRING_OF_Q1),
        ("none", []),
    ],
)
def test_a_switch_from_none_brings_the_queues_content(
    mode: str, expected: list[pc.Command]
) -> None:
    site = Site()
    queue_with_content(site)
    got = site.switch(switched(mode))
    assert got == [(Mode.from_label(mode), c) for c in expected]
    # The new rules are in force for what follows.
    after = site.forwarded(pc.Publish("", "q.1", b"three", ref=3))
    assert after == (
        [(Mode.from_label(mode), pc.Enqueue("dr.q.1", 3, b"three"))]
        if mode in ("full", "enqueue")
        else []
    )


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # D holds the wiring: the declare again, then only the messages.
        ("wiring", "full", [pc.QueueDeclare("dr.q.1", {"a": 1}), *MESSAGES_OF_Q1]),
        ("wiring", "enqueue", [pc.QueueDeclare("dr.q.1", {"a": 1}), *MESSAGES_OF_Q1]),
        # D's consumers changed D's copy: replaced whole.
        ("enqueue", "full", [pc.QueueDelete("dr.q.1"), *WIRING_OF_Q1, *MESSAGES_OF_Q1]),
        # D holds the messages already, or must not get them.
        ("full", "enqueue", [pc.QueueDeclare("dr.q.1", {"a": 1})]),
        ("full", "wiring", [pc.QueueDeclare("dr.q.1", {"a": 1})]),
        ("full", "none", []),
        ("full", "full", []),
    ],
)
def test_a_switch_between_modes_sends_what_d_lacks(
    old: str, new: str, expected: list[pc.Command]
) -> None:
    site = Site(switched(old))
    queue_with_content(site)
    assert site.switch(switched(new)) == [(Mode.from_label(new), c) for c in expected]


def test_a_switch_leaves_out_messages_the_new_rules_drop() -> None:
    site = Site()
    queue_with_content(site)
    drop_p = 'target: {prefix: "dr."}, drop: [{header: p, exists: true}]}'
    rules = switched("full").replace('target: {prefix: "dr."}}', drop_p, 1)
    assert rules != switched("full")
    got = site.switch(rules)
    assert [c for _, c in got if isinstance(c, pc.Enqueue)] == [MESSAGES_OF_Q1[1]]


def test_a_redeclare_that_changes_the_mode_sends_the_content() -> None:
    rules = 'version: 1\ndefault: {mode: from-args, fallback: none, target: {prefix: "dr."}}\n'
    site = Site(rules)
    site.run(pc.QueueDeclare("q.1", {"qpid.replicate": "configuration"}))
    site.run(pc.Publish("", "q.1", b"one", "m-1", ref=1))
    full = {"qpid.replicate": "all", "qpid.queue_event_generation": 2}
    assert site.forwarded(pc.QueueDeclare("q.1", full)) == [
        (Mode.FULL, pc.QueueDeclare("dr.q.1", full)),
        (Mode.FULL, pc.Enqueue("dr.q.1", 1, b"one", "m-1")),
    ]


@pytest.mark.parametrize("queue", ["f.q", "e.q"])
def test_a_paused_queue_forwards_nothing_and_on_resume_d_gets_what_it_lacks(queue: str) -> None:
    site = declared(queue)
    site.run(pc.Publish("", queue, b"one", "m-1", ref=1))
    paused = site.forwarded(pc.QueueDeclare(queue, {PAUSED_ARG: True}))
    assert paused == []  # D keeps its copy as it was
    assert site.tap.statistics().paused == (queue,)
    assert site.forwarded(pc.Publish("", queue, b"two", "m-2", ref=2)) == []
    assert site.forwarded(pc.Bind("amq.direct", queue, "k")) == []

    resumed = site.forwarded(pc.QueueDeclare(queue, {PAUSED_ARG: False}))
    assert site.tap.statistics().paused == ()
    mode, target = QUEUES[queue], "dr." + queue
    commands = [c for _, c in resumed]
    # A full replica went stale: replaced by P's queue.  An enqueue copy is
    # D's consumers': P's messages go again, and D keeps those above its mark.
    assert (pc.QueueDelete(target) in commands) == (mode == Mode.FULL)
    assert [c.message_id for c in commands if isinstance(c, pc.Enqueue)] == ["m-1", "m-2"]
    assert pc.Bind("amq.direct", target, "k") in commands
    assert {m for m, _ in resumed} == {mode}
    assert site.forwarded(pc.Publish("", queue, b"three", "m-3", ref=3)) != []


def test_a_bad_switch_keeps_the_old_rules_and_forwards_nothing() -> None:
    site = declared("f.q")
    got = site.forwarded(pc.RulesSwitch(b"not a rules payload"))
    assert got == []
    assert site.tap.rules_failures == 1
    assert "not applied" in site.tap.last_error
    assert site.forwarded(pc.Publish("", "f.q", b"m", ref=1)) == [
        (Mode.FULL, pc.Enqueue("dr.f.q", 1, b"m"))
    ]


@pytest.mark.parametrize(
    ("count", "size"),
    [(SWITCH_EVENT_MAX_MESSAGES + 1, 1), (40, SWITCH_EVENT_MAX_BYTES // 32)],
    ids=["many messages", "many bytes"],
)
def test_a_switch_of_a_queue_too_big_for_one_event_goes_by_a_resync(count: int, size: int) -> None:
    # 65,535 messages used to make the event's frame fail in every tap at once.
    site = Site()
    site.run(pc.QueueDeclare("q.1", {"a": 1}))
    for i in range(count):
        site.run(pc.Publish("", "q.1", bytes(size), ref=i + 1))
    before = site.tap.last_seq
    event = site.run(pc.RulesSwitch(RulesPayload.for_text(switched("full"), 1).to_bytes()))
    assert event is None  # no event: a gap at this cseq, which a resync closes
    assert site.tap.resyncs_requested == 1
    assert site.tap.last_seq == site.state.cseq > before
    after = site.run(pc.Publish("", "q.1", b"next", ref=count + 1))
    assert after is not None and after.prev_seq == site.state.cseq - 1
    (replicated,) = pc.decode_frame_untrusted(after.payload)
    assert isinstance(replicated, pc.Replicated)
    assert replicated.modes == (Mode.FULL,)  # the new rules are in force


def test_the_events_carry_the_sites_epoch_from_set_epoch_on() -> None:
    site = Site()
    site.tap.resync_rules(site.state)  # a sidecar's tap starts from its site's state
    assert site.tap.epoch == 1  # P's epoch is the site's, not a constant
    site.run(pc.SetEpoch(4))
    event = site.run(pc.QueueDeclare("f.q"))
    assert event is not None
    (replicated,) = pc.decode_frame_untrusted(event.payload)
    assert isinstance(replicated, pc.Replicated) and replicated.epoch == 4
