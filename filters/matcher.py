"""The compiled matcher: which mode a queue (or a message) gets.

Theory of operation.  A :class:`RuleSet` is built once from a validated
rules file (:func:`filters.rules.load_rules`) and never changes; a rules
switch builds a new one.  The tap asks it two questions:

``ruleset.decide_queue(queue, args) -> Decision``
    For everything that concerns a queue as a whole: declare, delete,
    bind/unbind, dequeue (accept), purge.  Only *queue rules* take part:
    rules whose ``match`` tests nothing but the queue name and the queue's
    declare arguments.  The first one that matches wins, else the default.

``ruleset.decide_message(queue, args, exchange, routing_key, headers, size)``
    For a publish routed to ``queue``.  Every rule takes part, in file
    order, so a *message rule* (one that tests the exchange, the routing key
    or headers) placed above a queue rule can select some of a queue's
    messages.  Returns the winning rule's :class:`Decision`, or a
    :class:`Drop` when that rule's mode forwards messages (``full``,
    ``enqueue``) but the message is larger than ``max_message_bytes`` or
    one of its ``drop`` header tests holds.

``ruleset.decisions[queue] -> Decision``
    The hot path for queue-level events: a plain ``dict`` holding the last
    decision :meth:`RuleSet.decide_queue` made for each queue (``KeyError``
    for a queue never decided).  The tap decides a queue when it is declared
    (and every queue after a rules switch, which it must do anyway to find
    the queues whose mode changed), then looks decisions up here at the cost
    of one dict lookup.

``ruleset.forget_queue(queue)``
    Drops what is cached for a deleted queue.

Speed.  Everything that depends only on the queue (its decision, the
message rules that could apply to it, the drop tests) is computed once per
queue and kept in a dict keyed by the queue name, together with the
``args`` object it was computed for.  A later call with the *same* args
object (the tap passes the mapping it keeps in its shadow state) is one
dict lookup and an identity test; equal-but-different args are compared
once and the entry refreshed.  Header tests run only for the message rules
that have them.  The cache holds one entry per queue asked about; the tap
calls ``forget_queue`` on delete, so it follows the live queues of the
shadow state, which the brokers bound.

Values of headers and arguments are compared as text (:func:`as_text`):
``1`` and ``"1"`` are equal, ``true`` equals ``"true"``.  The ``from-args``
mode is read from the Qpid arguments by :func:`protocol.modes.from_args_mode`.

Pure: no I/O, no clock, deterministic for a given rules text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from protocol.errors import Location, Problem
from protocol.modes import Mode, as_text, from_args_mode, replication_paused

FORWARDS_MESSAGES = frozenset({Mode.FULL, Mode.ENQUEUE})


# The rule name of a queue whose replication an operator paused
# (``drgate replicate pause``): mode none, whatever its rule says.
PAUSED = "(paused)"


@dataclass(frozen=True, slots=True)
class Decision:
    """What happens to a queue (or a message): its mode and name at D.

    ``rule_index`` is the rule's position in the file (0-based); the default
    action has index ``len(rules)`` and name ``"default"``.  ``max_size`` is
    the rule's ``max_message_bytes`` (``None``: no limit).
    """

    mode: Mode
    rule_name: str
    rule_index: int
    target_name: str
    max_size: int | None = None


@dataclass(frozen=True, slots=True)
class Drop:
    """A message its rule would forward, dropped by a filter.

    ``reason`` is ``"size"`` or ``"header"`` (a bounded label for metrics);
    ``detail`` says which limit or header test.
    """

    reason: Literal["size", "header"]
    rule_name: str
    rule_index: int
    detail: str


@dataclass(frozen=True, slots=True)
class HeaderTest:
    """One header predicate: ``equals``, ``exists`` or ``in`` (values as text)."""

    header: str
    op: Literal["equals", "exists", "in"]
    values: frozenset[str] = frozenset()
    exists: bool = True

    def holds(self, headers: Mapping[str, Any] | None) -> bool:
        if headers is None or self.header not in headers:
            return self.op == "exists" and not self.exists
        if self.op == "exists":
            return self.exists
        return as_text(headers[self.header]) in self.values

    def __str__(self) -> str:
        if self.op == "exists":
            return f"{self.header} {'exists' if self.exists else 'is absent'}"
        if self.op == "equals":
            return f"{self.header} = {next(iter(self.values))}"
        return f"{self.header} in [{', '.join(sorted(self.values))}]"


@dataclass(frozen=True, slots=True)
class Match:
    """What a rule tests.  Empty fields test nothing (match anything)."""

    queue_globs: tuple[str, ...] = ()
    queue_regex: str | None = None
    exchange_globs: tuple[str, ...] = ()
    routing_keys: tuple[str, ...] = ()
    headers: tuple[HeaderTest, ...] = ()
    args: tuple[tuple[str, str], ...] = ()

    @property
    def is_message_match(self) -> bool:
        return bool(self.exchange_globs or self.routing_keys or self.headers)


@dataclass(frozen=True, slots=True)
class Action:
    """What a rule does.  ``mode`` is ``None`` for ``from-args``."""

    mode: Mode | None
    fallback: Mode = Mode.NONE
    prefix: str = ""
    suffix: str = ""
    max_message_bytes: int | None = None
    drops: tuple[HeaderTest, ...] = ()

    @property
    def mode_label(self) -> str:
        return "from-args" if self.mode is None else self.mode.label


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    index: int
    location: Location
    match: Match
    action: Action

    @property
    def is_message_rule(self) -> bool:
        return self.match.is_message_match


# ------------------------------------------------------------------ compiling


def glob_regex(globs: tuple[str, ...]) -> str:
    """Shell globs (``*``, ``?``, ``[...]``) as one anchored regex."""
    import fnmatch

    return "|".join(f"(?:{fnmatch.translate(g)})" for g in globs)


def topic_regex(pattern: str) -> str:
    """An AMQP topic pattern as a regex over ``"." + routing_key``.

    Each word becomes ``\\.word``; ``*`` is exactly one word, ``#`` zero or
    more words.  Prefixing the key with a dot makes "zero words" simple.
    """
    parts = []
    for word in pattern.split("."):
        if word == "#":
            parts.append(r"(?:\.[^.]*)*")
        elif word == "*":
            parts.append(r"\.[^.]*")
        else:
            parts.append(r"\." + re.escape(word))
    return "".join(parts)


def _predicate(regex: str) -> Callable[[str], Any]:
    return re.compile(regex, re.DOTALL).fullmatch


class _MessageMatcher:
    """The message-level half of a message rule, with its decision for one queue."""

    __slots__ = ("decision", "drops", "exchange", "headers", "routing_key")

    def __init__(self, rule: Rule, decision: Decision, compiled: _CompiledRule) -> None:
        self.exchange = compiled.exchange
        self.routing_key = compiled.routing_key
        self.headers = rule.match.headers
        self.decision = decision
        self.drops = rule.action.drops

    def matches(self, exchange: str, routing_key: str, headers: Mapping[str, Any] | None) -> bool:
        if self.exchange is not None and self.exchange(exchange) is None:
            return False
        if self.routing_key is not None and self.routing_key("." + routing_key) is None:
            return False
        return all(test.holds(headers) for test in self.headers)


class _CompiledRule:
    __slots__ = ("exchange", "queue", "routing_key", "rule")

    def __init__(self, rule: Rule) -> None:
        m = rule.match
        self.rule = rule
        self.queue: Callable[[str], Any] | None = None
        if m.queue_regex is not None:
            self.queue = _predicate(m.queue_regex)
        elif m.queue_globs:
            self.queue = _predicate(glob_regex(m.queue_globs))
        self.exchange = _predicate(glob_regex(m.exchange_globs)) if m.exchange_globs else None
        self.routing_key = (
            _predicate("|".join(f"(?:{topic_regex(p)})" for p in m.routing_keys))
            if m.routing_keys
            else None
        )

    def queue_matches(self, queue: str, args: Mapping[str, Any] | None) -> bool:
        if self.queue is not None and self.queue(queue) is None:
            return False
        for key, text in self.rule.match.args:
            if not args or key not in args or as_text(args[key]) != text:
                return False
        return True


# Cache entry: (args object, queue decision, message matchers, queue rule's drops)
_Entry = tuple[Any, Decision, tuple[_MessageMatcher, ...], tuple[HeaderTest, ...]]


class RuleSet:
    """Compiled, immutable rules.  See the module docstring for the API.

    Attributes: ``rules`` (in file order), ``default`` (the default action
    as a rule named ``"default"``), ``text`` (the YAML it came from),
    ``digest`` (sha256 of the UTF-8 text, hex), ``path``, ``warnings``
    (problems of severity ``warning`` found when loading),
    ``rules_version`` (bumped by every switch; 0 for a file loaded at
    start-up) and ``cseq`` (the bus sequence at which a switch applied it).
    """

    def __init__(
        self,
        rules: list[Rule],
        default: Rule,
        *,
        text: str = "",
        path: str = "",
        digest: str = "",
        warnings: list[Problem] | None = None,
        rules_version: int = 0,
        cseq: int | None = None,
    ) -> None:
        self.rules = tuple(rules)
        self.default = default
        self.text = text
        self.path = path
        self.digest = digest
        self.warnings = list(warnings or [])
        self.rules_version = rules_version
        self.cseq = cseq
        self._compiled = [_CompiledRule(r) for r in (*self.rules, default)]
        self._cache: dict[str, _Entry] = {}
        # queue -> its last queue-level decision; a plain dict so that the
        # tap's lookup is as fast as a lookup can be (see the module doc).
        self.decisions: dict[str, Decision] = {}
        self.cache_misses = 0

    # -------------------------------------------------------------- questions

    def decide_queue(self, queue: str, args: Mapping[str, Any] | None = None) -> Decision:
        """The mode of ``queue`` (declared with ``args``) for queue-level events."""
        entry = self._cache.get(queue)
        if entry is not None and entry[0] is args:
            return entry[1]
        return self._entry(queue, args)[1]

    def decide_message(
        self,
        queue: str,
        args: Mapping[str, Any] | None,
        exchange: str,
        routing_key: str,
        headers: Mapping[str, Any] | None,
        size: int,
    ) -> Decision | Drop:
        """The decision for one message published to ``exchange`` with
        ``routing_key`` and routed to ``queue``; ``size`` in bytes."""
        entry = self._cache.get(queue)
        if entry is None or entry[0] is not args:
            entry = self._entry(queue, args)
        decision = entry[1]
        drops = entry[3]
        for candidate in entry[2]:
            if candidate.matches(exchange, routing_key, headers):
                decision = candidate.decision
                drops = candidate.drops
                break
        if decision.mode in FORWARDS_MESSAGES:
            if decision.max_size is not None and size > decision.max_size:
                return Drop(
                    "size",
                    decision.rule_name,
                    decision.rule_index,
                    f"{size} bytes > max_message_bytes {decision.max_size}",
                )
            for test in drops:
                if test.holds(headers):
                    return Drop("header", decision.rule_name, decision.rule_index, str(test))
        return decision

    def forwards_every_message(self, queue: str, args: Mapping[str, Any] | None) -> bool:
        """No message rule, size limit or drop can keep one of ``queue``'s
        messages from D: its replica can be compared whole (verification)."""
        entry = self._cache.get(queue)
        if entry is None or entry[0] is not args:
            entry = self._entry(queue, args)
        return not entry[2] and not entry[3] and entry[1].max_size is None

    def forget_queue(self, queue: str) -> None:
        """Drop what is cached for ``queue`` (call it when the queue is deleted)."""
        self._cache.pop(queue, None)
        self.decisions.pop(queue, None)

    def rule_at(self, index: int) -> Rule:
        """The rule with ``rule_index`` ``index`` (the default for ``len(rules)``)."""
        return self.default if index == len(self.rules) else self.rules[index]

    def statistics(self) -> dict[str, int]:
        return {
            "rules": len(self.rules),
            "cached_queues": len(self._cache),
            "cache_misses": self.cache_misses,
            "rules_version": self.rules_version,
        }

    # --------------------------------------------------------------- internal

    def _entry(self, queue: str, args: Mapping[str, Any] | None) -> _Entry:
        old = self._cache.get(queue)
        if old is not None and old[0] == args:
            entry: _Entry = (args, old[1], old[2], old[3])
        else:
            self.cache_misses += 1
            entry = self._compute(queue, args)
        self._cache[queue] = entry
        self.decisions[queue] = entry[1]
        return entry

    def _decision(self, rule: Rule, queue: str, args: Mapping[str, Any] | None) -> Decision:
        action = rule.action
        mode = action.mode
        if mode is None:
            mode = from_args_mode(args, action.fallback)[0]
        name = rule.name
        if mode != Mode.NONE and replication_paused(args):
            mode, name = Mode.NONE, PAUSED  # whatever the rule says, until resumed
        return Decision(
            mode, name, rule.index, action.prefix + queue + action.suffix,
            action.max_message_bytes,
        )  # fmt: skip

    def _compute(self, queue: str, args: Mapping[str, Any] | None) -> _Entry:
        candidates: list[_MessageMatcher] = []
        for compiled in self._compiled:
            rule = compiled.rule
            if not compiled.queue_matches(queue, args):
                continue
            decision = self._decision(rule, queue, args)
            if rule.is_message_rule:
                candidates.append(_MessageMatcher(rule, decision, compiled))
                continue
            return (args, decision, tuple(candidates), rule.action.drops)
        raise AssertionError("the default rule matches every queue")  # pragma: no cover

    def explain(
        self,
        queue: str,
        args: Mapping[str, Any] | None = None,
        *,
        exchange: str | None = None,
        routing_key: str | None = None,
        headers: Mapping[str, Any] | None = None,
        size: int = 0,
    ) -> tuple[Rule, Decision | Drop, str]:
        """For people: the rule that decides, the outcome, and how the mode
        was found.  Message-level when ``exchange`` or ``routing_key`` or
        ``headers`` is given, else queue-level."""
        if exchange is None and routing_key is None and headers is None:
            outcome: Decision | Drop = self.decide_queue(queue, args)
        else:
            outcome = self.decide_message(
                queue, args, exchange or "", routing_key or "", headers or {}, size
            )
        rule = self.rule_at(outcome.rule_index)
        if rule.action.mode is None:
            how = "from-args: " + from_args_mode(args, rule.action.fallback)[1]
        else:
            how = f"mode {rule.action.mode.label} set by the rule"
        return rule, outcome, how
