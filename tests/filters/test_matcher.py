"""The compiled matcher: table-driven decisions, from-args table, caching."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from filters.matcher import Decision, Drop, from_args_mode
from filters.rules import load_rules
from protocol.modes import Mode

RULES = textwrap.dedent("""\
    version: 1
    rules:
      - name: big-eu
        match:
          queue: trades
          exchange: "amq.*"
          routing_key: ["trade.*.eu", "audit.#"]
          headers:
            - {header: region, equals: eu}
            - {header: tier, in: [gold, 2]}
            - {header: test, exists: false}
        action: {mode: full, max_message_bytes: 100}
      - name: trades
        match: {queue: trades}
        action:
          mode: wiring
      - name: mirrored
        match: {queue: ["pay.*", "ledger"]}
        action:
          mode: full
          target: {prefix: "dr.", suffix: ".copy"}
          drop: [{header: local, exists: true}]
      - name: numbered
        match: {queue_regex: "job-[0-9]+"}
        action: {mode: enqueue}
      - name: by-arg
        match: {args: {x-class: gold}}
        action: {mode: enqueue}
      - name: qpid-apps
        match: {queue: "app.*"}
        action: {mode: from-args, fallback: wiring}
    default: {mode: none}
    """)


@pytest.fixture(scope="module")
def ruleset():  # type: ignore[no-untyped-def]
    return load_rules(RULES, "m.yaml")


# queue, args, expected (mode, rule, target)
QUEUE_CASES: list[tuple[str, dict[str, Any] | None, tuple[Mode, str, str]]] = [
    ("trades", None, (Mode.WIRING, "trades", "trades")),
    ("pay.in", None, (Mode.FULL, "mirrored", "dr.pay.in.copy")),
    ("pay", None, (Mode.NONE, "default", "pay")),
    ("ledger", None, (Mode.FULL, "mirrored", "dr.ledger.copy")),
    ("job-17", None, (Mode.ENQUEUE, "numbered", "job-17")),
    ("job-17x", None, (Mode.NONE, "default", "job-17x")),
    ("x", {"x-class": "gold"}, (Mode.ENQUEUE, "by-arg", "x")),
    ("x", {"x-class": "silver"}, (Mode.NONE, "default", "x")),
    ("app.a", None, (Mode.WIRING, "qpid-apps", "app.a")),
    ("app.a", {"qpid.replicate": "all"}, (Mode.FULL, "qpid-apps", "app.a")),
    ("app.a", {"qpid.replicate": "none"}, (Mode.NONE, "qpid-apps", "app.a")),
    ("app.a", {"qpid.queue_event_generation": 1}, (Mode.ENQUEUE, "qpid-apps", "app.a")),
    ("other", {"qpid.replicate": "all"}, (Mode.NONE, "default", "other")),
]


@pytest.mark.parametrize(("queue", "args", "expected"), QUEUE_CASES)
def test_decide_queue(ruleset, queue: str, args: dict[str, Any] | None, expected) -> None:  # type: ignore[no-untyped-def]
    d = ruleset.decide_queue(queue, args)
    assert (d.mode, d.rule_name, d.target_name) == expected
    assert ruleset.rule_at(d.rule_index).name == d.rule_name
    assert ruleset.decide_queue(queue, args) is d  # cached: the same object


GOOD = {"region": "eu", "tier": "gold"}

# queue, exchange, key, headers, size, expected rule name or ("drop", reason)
MESSAGE_CASES: list[tuple[str, str, str, dict[str, Any] | None, int, object]] = [
    ("trades", "amq.topic", "trade.fx.eu", GOOD, 10, "big-eu"),
    ("trades", "amq.direct", "audit", GOOD, 10, "big-eu"),  # '#' matches zero words
    ("trades", "amq.topic", "audit.a.b.c", GOOD, 10, "big-eu"),
    ("trades", "amq.topic", "trade.fx.eu", {"region": "eu", "tier": 2}, 10, "big-eu"),
    ("trades", "amq.topic", "trade.fx.eu", {"region": "eu", "tier": "2"}, 10, "big-eu"),
    ("trades", "amq.topic", "trade.fx.uk", GOOD, 10, "trades"),
    ("trades", "amq.topic", "trade.eu", GOOD, 10, "trades"),  # '*' is exactly one word
    ("trades", "amq.topic", "trade.fx.x.eu", GOOD, 10, "trades"),
    ("trades", "other", "trade.fx.eu", GOOD, 10, "trades"),
    ("trades", "amq.topic", "trade.fx.eu", {"region": "eu"}, 10, "trades"),
    ("trades", "amq.topic", "trade.fx.eu", {**GOOD, "test": 1}, 10, "trades"),
    ("trades", "amq.topic", "trade.fx.eu", None, 10, "trades"),
    ("trades", "amq.topic", "trade.fx.eu", GOOD, 101, ("drop", "size")),
    ("trades", "amq.topic", "trade.fx.eu", GOOD, 100, "big-eu"),
    ("pay.in", "", "k", {"local": "yes"}, 10, ("drop", "header")),
    ("pay.in", "", "k", {"other": "yes"}, 10, "mirrored"),
    ("nowhere", "", "k", {"local": "yes"}, 10, "default"),  # mode none: not a drop
]


@pytest.mark.parametrize(("queue", "exchange", "key", "headers", "size", "expected"), MESSAGE_CASES)
def test_decide_message(ruleset, queue, exchange, key, headers, size, expected) -> None:  # type: ignore[no-untyped-def]
    outcome = ruleset.decide_message(queue, None, exchange, key, headers, size)
    if isinstance(expected, tuple):
        assert isinstance(outcome, Drop)
        assert outcome.reason == expected[1]
    else:
        assert isinstance(outcome, Decision)
        assert outcome.rule_name == expected


# qpid.replicate, qpid.queue_event_generation, expected mode (fallback WIRING)
FROM_ARGS: list[tuple[object, object, Mode]] = [
    (None, None, Mode.WIRING),
    ("all", None, Mode.FULL),
    ("all", 1, Mode.ENQUEUE),
    ("all", "2", Mode.FULL),
    ("all", 0, Mode.FULL),
    ("ALL ", None, Mode.FULL),
    ("configuration", None, Mode.WIRING),
    ("configuration", 2, Mode.WIRING),
    ("none", 2, Mode.NONE),
    ("none", 1, Mode.NONE),
    (None, 1, Mode.ENQUEUE),
    (None, "1", Mode.ENQUEUE),
    (None, 2, Mode.FULL),
    (None, 0, Mode.WIRING),
    (None, 3, Mode.WIRING),
    ("bogus", None, Mode.WIRING),
    ("bogus", 2, Mode.FULL),
]


@pytest.mark.parametrize(("replicate", "generation", "expected"), FROM_ARGS)
def test_from_args_table(replicate: object, generation: object, expected: Mode) -> None:
    args = {}
    if replicate is not None:
        args["qpid.replicate"] = replicate
    if generation is not None:
        args["qpid.queue_event_generation"] = generation
    assert from_args_mode(args, Mode.WIRING)[0] is expected


def test_cache_is_keyed_by_args_object_and_refreshed_when_args_change() -> None:
    rs = load_rules("version: 1\ndefault: {mode: from-args}\n", "c.yaml")
    a1 = {"qpid.replicate": "all"}
    assert rs.decide_queue("q", a1).mode is Mode.FULL
    assert rs.decide_queue("q", dict(a1)).mode is Mode.FULL  # equal args: no recompute
    assert rs.statistics()["cache_misses"] == 1
    assert rs.decide_queue("q", {"qpid.replicate": "none"}).mode is Mode.NONE
    assert rs.decide_queue("q", None).mode is Mode.NONE  # fallback
    assert rs.statistics()["cache_misses"] == 3


def test_header_tests_run_only_for_rules_that_have_them() -> None:
    rs = load_rules(
        "version: 1\nrules:\n"
        "  - name: h\n"
        "    match: {queue: a, headers: [{header: x, exists: true}]}\n"
        "    action: {mode: full}\n"
        "default: {mode: enqueue}\n",
        "h.yaml",
    )

    class Exploding(dict):  # type: ignore[type-arg]
        def __contains__(self, key: object) -> bool:
            raise AssertionError("headers were looked at")

    # queue b: no message rule applies, headers are never touched
    assert rs.decide_message("b", None, "", "k", Exploding(), 1).rule_name == "default"  # type: ignore[union-attr]
    with pytest.raises(AssertionError, match="looked at"):
        rs.decide_message("a", None, "", "k", Exploding(), 1)


def test_decisions_is_a_plain_dict_of_last_decisions_and_forget_drops_them() -> None:
    rs = load_rules("version: 1\ndefault: {mode: from-args}\n", "b.yaml")
    assert type(rs.decisions) is dict
    with pytest.raises(KeyError):
        rs.decisions["q"]
    d = rs.decide_queue("q", {"qpid.replicate": "all"})
    assert rs.decisions["q"] is d
    rs.forget_queue("q")
    assert "q" not in rs.decisions
    assert rs.statistics()["cached_queues"] == 0


def test_explain_names_rule_and_how() -> None:
    rs = load_rules(RULES, "m.yaml")
    rule, outcome, how = rs.explain("app.x", {"qpid.queue_event_generation": "1"})
    assert rule.name == "qpid-apps"
    assert rule.location.line == 29  # "- name: qpid-apps"
    assert isinstance(outcome, Decision)
    assert outcome.mode is Mode.ENQUEUE
    assert how == "from-args: qpid.queue_event_generation=1"
    rule, outcome, _ = rs.explain("trades", exchange="amq.x", routing_key="audit", headers=GOOD)
    assert rule.name == "big-eu"
