"""The replication rules file: schema, loading with located errors, compiling.

:func:`load_rules` turns the YAML text of a rules file into a compiled
:class:`~filters.matcher.RuleSet`, or raises
:class:`~protocol.errors.RulesError` listing *every* mistake, each with
file:line:column and a hint.  Warnings (rules that can never match) do not
stop loading; they are on ``ruleset.warnings``.  The schema, an example per
scenario and the list of messages are in docs/rules.md.

Schema (version 1)::

    version: 1                       # required
    rules:                           # optional; first match wins
      - name: audit                  # required, unique
        description: free text       # optional
        match:                       # required ({} matches everything)
          queue: "audit.*"           # glob or list of globs   } at most
          queue_regex: "^audit\\d+$" # Python regex, fullmatch } one of these
          exchange: "amq.topic"      # glob or list of globs
          routing_key: "orders.#"    # AMQP topic pattern or list of them
          headers:                   # every test must hold
            - {header: region, equals: eu}
            - {header: trace, exists: true}
            - {header: tier, in: [gold, silver]}
          args: {qpid.replicate: all}  # the queue's declare arguments
        action:                      # required
          mode: full                 # full | enqueue | wiring | none | from-args
          fallback: none             # from-args only: mode when no argument says
          target: {prefix: "dr.", suffix: ""}   # the queue's name at D
          max_message_bytes: 1048576 # larger messages are dropped
          drop:                      # a message matching any test is dropped
            - {header: x-local-only, exists: true}
    default:                         # required: an action, used when no rule matches
      mode: from-args
"""

from __future__ import annotations

import fnmatch
import hashlib
import re

from protocol.errors import Location, Problem, RulesError
from protocol.modes import Mode, as_text

from .matcher import Action, HeaderTest, Match, Rule, RuleSet, topic_regex
from .yamldoc import (
    Node,
    Problems,
    check_keys,
    expect_bool,
    expect_int,
    expect_list,
    expect_scalar,
    expect_str,
    expect_str_list,
    nearest_hint,
    parse,
    sorted_problems,
    wrong_type,
)

__all__ = ["SCHEMA_VERSION", "load_rules"]

SCHEMA_VERSION = 1

TOP_KEYS = ("version", "rules", "default")
RULE_KEYS = ("name", "description", "match", "action")
MATCH_KEYS = ("queue", "queue_regex", "exchange", "routing_key", "headers", "args")
ACTION_KEYS = ("mode", "fallback", "target", "max_message_bytes", "drop")
TARGET_KEYS = ("prefix", "suffix")
HEADER_TEST_KEYS = ("header", "equals", "exists", "in")
MODE_LABELS = ("full", "enqueue", "wiring", "none", "from-args")
FALLBACK_LABELS = ("full", "enqueue", "wiring", "none")
DEFAULT_NAME = "default"


def load_rules(text: str, path: str, *, rules_version: int = 0, cseq: int | None = None) -> RuleSet:
    """Validate and compile a rules file.

    ``path`` is used only in messages.  Raises ``RulesError`` with every
    error found (syntax, unknown keys, wrong types, unknown modes, bad
    regexes and topic patterns, duplicate names, missing ``version`` or
    ``default``); nothing else escapes for any input text.
    """
    problems = Problems()
    root = parse(text, path, error=RulesError)
    fields = check_keys(root, problems, what="the rules file", optional=TOP_KEYS)
    rules: list[Rule] = []
    default: Rule | None = None
    if fields is not None:
        if "version" not in fields:
            problems.error(
                root.location, "missing key 'version' in the rules file", "add 'version: 1'"
            )
        else:
            version = expect_int(fields["version"], problems, what="'version'")
            if version is not None and version != SCHEMA_VERSION:
                problems.error(
                    fields["version"].location,
                    f"unsupported rules version {version}",
                    f"this drgate reads version {SCHEMA_VERSION}",
                )
        if "rules" in fields:
            rules = _rules(fields["rules"], problems)
        if "default" not in fields:
            problems.error(
                root.location,
                "missing key 'default' in the rules file",
                "every rules file needs a default action, e.g. "
                "'default: {mode: from-args, fallback: none}'",
            )
        else:
            action = _action(fields["default"], problems, what="the default action")
            if action is not None:
                default = Rule(
                    DEFAULT_NAME, len(rules), fields["default"].location, Match(), action
                )
    problems.raise_if_any(RulesError)
    assert default is not None  # every path that leaves it None records an error
    for problem in _shadowed(rules, default):
        problems.items.append(problem)
    return RuleSet(
        rules,
        default,
        text=text,
        path=path,
        digest=hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(),
        warnings=sorted_problems(problems.warnings),
        rules_version=rules_version,
        cseq=cseq,
    )


# ---------------------------------------------------------------- the pieces


def _rules(node: Node, problems: Problems) -> list[Rule]:
    items = expect_list(node, problems, what="'rules'")
    if items is None:
        return []
    rules: list[Rule] = []
    first_use: dict[str, Location] = {}
    for item in items:
        fields = check_keys(
            item, problems, what="a rule", required=("name", "match", "action"),
            optional=("description",),
        )  # fmt: skip
        if fields is None:
            continue
        name = None
        if "name" in fields:
            name_node = fields["name"]
            name = expect_str(name_node, problems, what="'name'")
            if name == DEFAULT_NAME:
                problems.error(
                    name_node.location,
                    f"rule name '{DEFAULT_NAME}' is reserved for the default action",
                    "choose another name",
                )
                name = None
            elif name is not None and name in first_use:
                first = first_use[name]
                problems.error(
                    name_node.location,
                    f"duplicate rule name '{name}'",
                    f"first used at line {first.line}, column {first.column}",
                )
                name = None
            elif name is not None:
                first_use[name] = name_node.location
        if "description" in fields:
            expect_str(fields["description"], problems, what="'description'", allow_empty=True)
        match = _match(fields["match"], problems) if "match" in fields else None
        action = None
        if "action" in fields:
            action = _action(fields["action"], problems, what="the action of a rule")
        if name is not None and match is not None and action is not None:
            rules.append(Rule(name, len(rules), item.location, match, action))
    return rules


def _match(node: Node, problems: Problems) -> Match | None:
    fields = check_keys(node, problems, what="'match'", optional=MATCH_KEYS)
    if fields is None:
        return None
    ok = True
    queue_globs: tuple[str, ...] = ()
    queue_regex = None
    if "queue" in fields and "queue_regex" in fields:
        problems.error(
            fields["queue_regex"].location,
            "'queue' and 'queue_regex' cannot be used together",
            "keep one: a glob in 'queue' or a regular expression in 'queue_regex'",
        )
        ok = False
    if "queue" in fields:
        globs = expect_str_list(fields["queue"], problems, what="'queue'")
        ok = ok and globs is not None
        queue_globs = tuple(g for g, _ in globs or ())
    if "queue_regex" in fields:
        regex_node = fields["queue_regex"]
        queue_regex = expect_str(regex_node, problems, what="'queue_regex'")
        if queue_regex is None:
            ok = False
        else:
            try:
                re.compile(queue_regex)
            except re.error as exc:
                problems.error(
                    regex_node.location,
                    f"invalid regular expression: {exc.msg} at position {exc.pos}",
                    "Python 're' syntax; for shell-style patterns use 'queue'",
                )
                ok = False
            except (RecursionError, OverflowError, ValueError) as exc:
                problems.error(regex_node.location, f"invalid regular expression: {exc}", "")
                ok = False
    exchange_globs: tuple[str, ...] = ()
    if "exchange" in fields:
        exchanges = _exchange_globs(fields["exchange"], problems)
        ok = ok and exchanges is not None
        exchange_globs = exchanges or ()
    routing_keys: tuple[str, ...] = ()
    if "routing_key" in fields:
        keys = _topic_patterns(fields["routing_key"], problems)
        ok = ok and keys is not None
        routing_keys = keys or ()
    headers: tuple[HeaderTest, ...] = ()
    if "headers" in fields:
        tests = _header_tests(fields["headers"], problems, what="'headers'")
        ok = ok and tests is not None
        headers = tests or ()
    args: tuple[tuple[str, str], ...] = ()
    if "args" in fields:
        arg_fields = check_keys_any(fields["args"], problems)
        if arg_fields is None:
            ok = False
        else:
            pairs = []
            for key, value_node in arg_fields.items():
                value = expect_scalar(value_node, problems, what=f"the value of argument '{key}'")
                if value is None:
                    ok = False
                else:
                    pairs.append((key, as_text(value)))
            args = tuple(pairs)
    if not ok:
        return None
    return Match(queue_globs, queue_regex, exchange_globs, routing_keys, headers, args)


def check_keys_any(node: Node, problems: Problems) -> dict[str, Node] | None:
    """A mapping with any string keys (the queue's declare arguments)."""
    if node.kind != "mapping":
        wrong_type(node, problems, "'args'", "a mapping", "e.g. {qpid.replicate: all}")
        return None
    value: dict[str, Node] = node.value
    return value


def _exchange_globs(node: Node, problems: Problems) -> tuple[str, ...] | None:
    # The default exchange is named "": allow the empty string here.
    if node.kind == "scalar" and node.value == "":
        return ("",)
    items = expect_str_list(node, problems, what="'exchange'")
    return None if items is None else tuple(g for g, _ in items)


def _topic_patterns(node: Node, problems: Problems) -> tuple[str, ...] | None:
    if node.kind == "scalar" and node.value == "":
        return ("",)
    items = expect_str_list(node, problems, what="'routing_key'")
    if items is None:
        return None
    ok = True
    for pattern, item in items:
        for word in pattern.split("."):
            if word not in ("*", "#") and ("*" in word or "#" in word):
                problems.error(
                    item.location,
                    f"routing-key pattern {pattern!r}: word {word!r} mixes a wildcard "
                    "with other characters",
                    "'*' (one word) and '#' (zero or more words) stand alone between dots, "
                    "e.g. 'orders.*.eu' or 'orders.#'",
                )
                ok = False
                break
    return tuple(p for p, _ in items) if ok else None


def _header_tests(node: Node, problems: Problems, *, what: str) -> tuple[HeaderTest, ...] | None:
    items = expect_list(node, problems, what=what)
    if items is None:
        return None
    tests: list[HeaderTest] = []
    ok = True
    for item in items:
        test = _header_test(item, problems)
        if test is None:
            ok = False
        else:
            tests.append(test)
    return tuple(tests) if ok else None


def _header_test(node: Node, problems: Problems) -> HeaderTest | None:
    fields = check_keys(
        node, problems, what="a header test", required=("header",),
        optional=("equals", "exists", "in"),
    )  # fmt: skip
    if fields is None:
        return None
    ops = [k for k in ("equals", "exists", "in") if k in fields]
    header = expect_str(fields["header"], problems, what="'header'") if "header" in fields else None
    unknown = set(node.value) - set(HEADER_TEST_KEYS)
    if len(ops) > 1 or (not ops and not unknown):
        problems.error(
            node.location,
            "a header test needs exactly one of 'equals', 'exists', 'in'"
            + (f", got {', '.join(ops)}" if ops else ""),
            "e.g. {header: region, equals: eu}",
        )
        return None
    if header is None or len(ops) != 1:
        return None
    op = ops[0]
    value_node = fields[op]
    if op == "equals":
        value = expect_scalar(value_node, problems, what="'equals'")
        return None if value is None else HeaderTest(header, "equals", frozenset({as_text(value)}))
    if op == "exists":
        flag = expect_bool(value_node, problems, what="'exists'")
        return None if flag is None else HeaderTest(header, "exists", exists=flag)
    values_nodes = expect_list(value_node, problems, what="'in'")
    if values_nodes is None:
        return None
    if not values_nodes:
        problems.error(value_node.location, "'in' must not be an empty list")
        return None
    values = [expect_scalar(v, problems, what="each value of 'in'") for v in values_nodes]
    if any(v is None for v in values):
        return None
    return HeaderTest(header, "in", frozenset(as_text(v) for v in values if v is not None))


def _mode(node: Node, problems: Problems, *, what: str, labels: tuple[str, ...]) -> str | None:
    label = expect_str(node, problems, what=what)
    if label is None:
        return None
    if label not in labels:
        problems.error(node.location, f"unknown mode '{label}'", nearest_hint(label, labels))
        return None
    return label


def _action(node: Node, problems: Problems, *, what: str) -> Action | None:
    fields = check_keys(
        node, problems, what=what, required=("mode",),
        optional=tuple(k for k in ACTION_KEYS if k != "mode"),
    )  # fmt: skip
    if fields is None:
        return None
    ok = True
    label = (
        _mode(fields["mode"], problems, what="'mode'", labels=MODE_LABELS)
        if "mode" in fields
        else None
    )
    ok = label is not None
    fallback = Mode.NONE
    if "fallback" in fields:
        fb_node = fields["fallback"]
        if label is not None and label != "from-args":
            problems.error(
                fb_node.location,
                "'fallback' is only used with mode 'from-args'",
                f"remove it, or set 'mode: from-args' instead of '{label}'",
            )
            ok = False
        fb_label = _mode(fb_node, problems, what="'fallback'", labels=FALLBACK_LABELS)
        if fb_label is None:
            ok = False
        else:
            fallback = Mode.from_label(fb_label)
    prefix = suffix = ""
    if "target" in fields:
        target = check_keys(fields["target"], problems, what="'target'", optional=TARGET_KEYS)
        if target is None:
            ok = False
        else:
            if "prefix" in target:
                p = expect_str(target["prefix"], problems, what="'prefix'", allow_empty=True)
                ok = ok and p is not None
                prefix = p or ""
            if "suffix" in target:
                s = expect_str(target["suffix"], problems, what="'suffix'", allow_empty=True)
                ok = ok and s is not None
                suffix = s or ""
    max_bytes = None
    if "max_message_bytes" in fields:
        max_bytes = expect_int(
            fields["max_message_bytes"], problems, what="'max_message_bytes'", minimum=1
        )
        ok = ok and max_bytes is not None
    drops: tuple[HeaderTest, ...] = ()
    if "drop" in fields:
        tests = _header_tests(fields["drop"], problems, what="'drop'")
        ok = ok and tests is not None
        drops = tests or ()
    if not ok or label is None:
        return None
    mode = None if label == "from-args" else Mode.from_label(label)
    return Action(mode, fallback, prefix, suffix, max_bytes, drops)


# ---------------------------------------------------------------- shadowing


_GLOB_CHARS = frozenset("*?[")


def _globs_cover(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Every name matched by one of ``b`` is matched by one of ``a`` (conservative)."""

    def one(p: str) -> bool:
        for g in a:
            if g in (p, "*"):
                return True
            if not (_GLOB_CHARS & set(p)) and fnmatch.fnmatchcase(p, g):
                return True
        return False

    return all(one(p) for p in b)


def _topics_cover(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    def one(p: str) -> bool:
        for t in a:
            if t in (p, "#"):
                return True
            if "*" not in p and "#" not in p and re.fullmatch(topic_regex(t), "." + p):
                return True
        return False

    return all(one(p) for p in b)


def _covers(a: Match, b: Match) -> bool:
    """Whatever ``b`` matches, ``a`` matches too (a sufficient test)."""
    if a.queue_regex is not None:
        if b.queue_regex != a.queue_regex:
            return False
    elif a.queue_globs:
        if b.queue_regex is not None:
            if "*" not in a.queue_globs:
                return False
        elif not b.queue_globs or not _globs_cover(a.queue_globs, b.queue_globs):
            return False
    if a.exchange_globs and (
        not b.exchange_globs or not _globs_cover(a.exchange_globs, b.exchange_globs)
    ):
        return False
    if a.routing_keys and (not b.routing_keys or not _topics_cover(a.routing_keys, b.routing_keys)):
        return False
    if not set(a.headers) <= set(b.headers):
        return False
    return set(a.args) <= set(b.args)


def _shadowed(rules: list[Rule], default: Rule) -> list[Problem]:
    """Warnings for rules an earlier rule always wins over.

    A queue rule (no message tests) is decided among queue rules only, so
    only an earlier queue rule can shadow it; a message rule can be shadowed
    by any earlier rule.
    """
    found: list[Problem] = []
    for j, later in enumerate(rules):
        for earlier in rules[:j]:
            if (later.is_message_rule or not earlier.is_message_rule) and _covers(
                earlier.match, later.match
            ):
                found.append(
                    Problem(
                        later.location,
                        f"rule '{later.name}' can never match: rule '{earlier.name}' "
                        f"(line {earlier.location.line}) matches everything it matches",
                        f"move '{later.name}' above '{earlier.name}', or remove it",
                        severity="warning",
                    )
                )
                break
    for earlier in rules:
        if not earlier.is_message_rule and _covers(earlier.match, default.match):
            found.append(
                Problem(
                    default.location,
                    f"the default action is never used: rule '{earlier.name}' "
                    f"(line {earlier.location.line}) matches every queue",
                    f"make '{earlier.name}' the default action, or narrow its 'match'",
                    severity="warning",
                )
            )
            break
    return found
