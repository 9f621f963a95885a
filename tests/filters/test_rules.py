"""Rules loading: every error message at its exact file, line and column."""

# ruff: noqa: E501  (the tables read best one case per line)

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from filters.matcher import RuleSet
from filters.rules import load_rules
from protocol.errors import RulesError
from protocol.modes import Mode

ROOT = Path(__file__).resolve().parents[2]
F = "r.yaml"

OK_TAIL = "default: {mode: none}\n"


def problems_of(text: str) -> list[tuple[int, int, str, str]]:
    with pytest.raises(RulesError) as info:
        load_rules(textwrap.dedent(text), F)
    out = []
    for p in info.value.problems:
        assert p.location.file == F
        out.append((p.location.line, p.location.column, p.message, p.hint))
    return out


# (id, text, line, column, message, hint fragment)
ERRORS = [
    ("yaml-syntax", "version: 1\nrules: [\n", 3, 1,
     "YAML syntax error: while parsing a flow node, did not find expected node content", "indentation"),
    ("yaml-tab", "version: 1\n\tdefault: 1\n", 2, 1,
     "YAML syntax error: while scanning a plain scalar, found a tab character that violates indentation",
     "indent with spaces, not tabs"),
    ("yaml-control-char", "version: 1\ndefault: \x07\n", 2, 10,
     "YAML syntax error: control characters are not allowed (character 7)", "remove"),
    ("two-documents", "version: 1\n---\nversion: 1\n", 2, 1,
     "YAML syntax error: expected a single document in the stream, but found another document",
     "one document"),
    ("empty", "# only a comment\n", 1, 1, "the file is empty", ""),
    ("duplicate-key", "version: 1\nversion: 1\n" + OK_TAIL, 2, 1, "duplicate key 'version'",
     "first defined at line 1, column 1"),
    ("non-string-key", "version: 1\n[a]: 1\n" + OK_TAIL, 2, 1, "keys must be strings, got a list",
     "quote"),
    ("merge-key", "version: 1\n<<: {a: 1}\n" + OK_TAIL, 2, 1, "merge keys ('<<') are not supported", ""),
    ("bad-tag", "version: !!python/name:os.system x\n" + OK_TAIL, 1, 10,
     "cannot read value with tag 'tag:yaml.org,2002:python/name:os.system': could not determine "
     "a constructor for the tag 'tag:yaml.org,2002:python/name:os.system'", "remove the tag"),
    ("recursive-alias", "version: 1\nrules: &a [*a]\n" + OK_TAIL, 2, 8, "recursive alias", ""),
    ("top-not-mapping", "- version: 1\n", 1, 1, "the rules file must be a mapping, got a list", ""),
    ("unknown-top-key", "version: 1\nrule: []\n" + OK_TAIL, 2, 1, "unknown key 'rule' in the rules file",
     "did you mean 'rules'?"),
    ("missing-version", OK_TAIL, 1, 1, "missing key 'version' in the rules file", "version: 1"),
    ("version-type", "version: '1'\n" + OK_TAIL, 1, 10, "'version' must be an integer, got a string", ""),
    ("version-unsupported", "version: 2\n" + OK_TAIL, 1, 10, "unsupported rules version 2",
     "this drgate reads version 1"),
    ("missing-default", "version: 1\n", 1, 1, "missing key 'default' in the rules file",
     "default: {mode: from-args"),
    ("rules-not-list", "version: 1\nrules: {a: 1}\n" + OK_TAIL, 2, 8, "'rules' must be a list, got a mapping", ""),
    ("rule-not-mapping", "version: 1\nrules: [x]\n" + OK_TAIL, 2, 9, "a rule must be a mapping, got a string", ""),
    ("unknown-rule-key", """\
        version: 1
        rules:
          - name: a
            mach: {queue: q}
            action: {mode: full}
        default: {mode: none}
        """, 4, 5, "unknown key 'mach' in a rule", "did you mean 'match'?"),
    ("missing-action", """\
        version: 1
        rules:
          - name: a
            match: {queue: q}
        default: {mode: none}
        """, 3, 5, "missing key 'action' in a rule", ""),
    ("name-type", """\
        version: 1
        rules:
          - name: 12
            match: {}
            action: {mode: full}
        default: {mode: none}
        """, 3, 11, "'name' must be a string, got an integer", "quote"),
    ("duplicate-rule-name", """\
        version: 1
        rules:
          - name: a
            match: {queue: q}
            action: {mode: full}
          - name: a
            match: {queue: r}
            action: {mode: full}
        default: {mode: none}
        """, 6, 11, "duplicate rule name 'a'", "first used at line 3, column 11"),
    ("reserved-name", """\
        version: 1
        rules:
          - name: default
            match: {queue: q}
            action: {mode: full}
        default: {mode: none}
        """, 3, 11, "rule name 'default' is reserved for the default action", ""),
    ("unknown-match-key", """\
        version: 1
        rules:
          - name: a
            match: {queues: q}
            action: {mode: full}
        default: {mode: none}
        """, 4, 13, "unknown key 'queues' in 'match'", "did you mean 'queue'?"),
    ("queue-and-regex", """\
        version: 1
        rules:
          - name: a
            match: {queue: q, queue_regex: q}
            action: {mode: full}
        default: {mode: none}
        """, 4, 36, "'queue' and 'queue_regex' cannot be used together", "keep one"),
    ("bad-regex", """\
        version: 1
        rules:
          - name: a
            match:
              queue_regex: "orders(["
            action: {mode: full}
        default: {mode: none}
        """, 5, 20, "invalid regular expression: unterminated character set at position 7",
     "Python 're' syntax"),
    ("queue-item-type", """\
        version: 1
        rules:
          - name: a
            match: {queue: [q, 3]}
            action: {mode: full}
        default: {mode: none}
        """, 4, 24, "each item of 'queue' must be a string, got an integer", ""),
    ("queue-empty-list", """\
        version: 1
        rules:
          - name: a
            match: {queue: []}
            action: {mode: full}
        default: {mode: none}
        """, 4, 20, "'queue' must not be an empty list", ""),
    ("queue-empty-string", """\
        version: 1
        rules:
          - name: a
            match: {queue: ""}
            action: {mode: full}
        default: {mode: none}
        """, 4, 20, "'queue' must not be empty", ""),
    ("bad-topic", """\
        version: 1
        rules:
          - name: a
            match: {routing_key: "orders.eu#"}
            action: {mode: full}
        default: {mode: none}
        """, 4, 26,
     "routing-key pattern 'orders.eu#': word 'eu#' mixes a wildcard with other characters",
     "stand alone between dots"),
    ("header-two-ops", """\
        version: 1
        rules:
          - name: a
            match:
              headers:
                - {header: h, equals: 1, exists: true}
            action: {mode: full}
        default: {mode: none}
        """, 6, 11, "a header test needs exactly one of 'equals', 'exists', 'in', got equals, exists",
     "{header: region, equals: eu}"),
    ("header-unknown-key", """\
        version: 1
        rules:
          - name: a
            match:
              headers:
                - {header: h, equal: 1}
            action: {mode: full}
        default: {mode: none}
        """, 6, 23, "unknown key 'equal' in a header test", "did you mean 'equals'?"),
    ("header-exists-type", """\
        version: 1
        rules:
          - name: a
            match:
              headers:
                - {header: h, exists: maybe}
            action: {mode: full}
        default: {mode: none}
        """, 6, 31, "'exists' must be true or false, got a string", ""),
    ("header-in-empty", """\
        version: 1
        rules:
          - name: a
            match:
              headers: [{header: h, in: []}]
            action: {mode: full}
        default: {mode: none}
        """, 5, 33, "'in' must not be an empty list", ""),
    ("header-equals-null", """\
        version: 1
        rules:
          - name: a
            match:
              headers: [{header: h, equals: null}]
            action: {mode: full}
        default: {mode: none}
        """, 5, 37, "'equals' must be a string, number or boolean, got nothing (null)", ""),
    ("args-not-mapping", """\
        version: 1
        rules:
          - name: a
            match: {args: [qpid.replicate]}
            action: {mode: full}
        default: {mode: none}
        """, 4, 19, "'args' must be a mapping, got a list", "qpid.replicate: all"),
    ("args-value-type", """\
        version: 1
        rules:
          - name: a
            match: {args: {qpid.replicate: [all]}}
            action: {mode: full}
        default: {mode: none}
        """, 4, 36, "the value of argument 'qpid.replicate' must be a string, number or boolean, got a list",
     ""),
    ("unknown-mode", "version: 1\ndefault: {mode: ful}\n", 2, 17, "unknown mode 'ful'", "did you mean 'full'?"),
    ("mode-type", "version: 1\ndefault: {mode: off}\n", 2, 17, "'mode' must be a string, got a boolean", ""),
    ("missing-mode", "version: 1\ndefault: {fallback: none}\n", 2, 10, "missing key 'mode' in the default action",
     ""),
    ("unknown-action-key", "version: 1\ndefault: {mode: none, prefix: x}\n", 2, 23,
     "unknown key 'prefix' in the default action", "valid: mode, fallback, target"),
    ("fallback-without-from-args", "version: 1\ndefault: {mode: full, fallback: none}\n", 2, 33,
     "'fallback' is only used with mode 'from-args'", "set 'mode: from-args' instead of 'full'"),
    ("fallback-from-args", "version: 1\ndefault: {mode: from-args, fallback: from-args}\n", 2, 38,
     "unknown mode 'from-args'", "valid: full, enqueue, wiring, none"),
    ("target-unknown-key", "version: 1\ndefault: {mode: full, target: {prefx: d.}}\n", 2, 32,
     "unknown key 'prefx' in 'target'", "did you mean 'prefix'?"),
    ("target-prefix-type", "version: 1\ndefault: {mode: full, target: {prefix: 1}}\n", 2, 40,
     "'prefix' must be a string, got an integer", ""),
    ("max-size-zero", "version: 1\ndefault: {mode: full, max_message_bytes: 0}\n", 2, 42,
     "'max_message_bytes' must be at least 1, got 0", ""),
    ("max-size-type", "version: 1\ndefault: {mode: full, max_message_bytes: 1MB}\n", 2, 42,
     "'max_message_bytes' must be an integer, got a string", ""),
    ("drop-not-list", "version: 1\ndefault: {mode: full, drop: {header: h, exists: true}}\n", 2, 29,
     "'drop' must be a list, got a mapping", ""),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "line", "column", "message", "hint"),
    [pytest.param(*case[1:], id=case[0]) for case in ERRORS],
)
def test_each_error_has_its_exact_place(
    text: str, line: int, column: int, message: str, hint: str
) -> None:
    found = problems_of(text)
    assert (line, column, message) in [(ln, c, m) for ln, c, m, _ in found], found
    hints = [h for ln, c, m, h in found if (ln, c, m) == (line, column, message)]
    assert hint in hints[0]


def test_every_mistake_is_reported_at_once() -> None:
    found = problems_of("""\
        version: 3
        rules:
          - name: a
            match: {queue: q, colour: red}
            action: {mode: fulll}
          - name: a
            match: {queue_regex: "("}
            action: {mode: none}
        """)
    places = [(ln, c) for ln, c, _, _ in found]
    assert places == sorted(places)
    assert len(found) == 6, found
    messages = " | ".join(m for _, _, m, _ in found)
    for fragment in (
        "version 3",
        "'colour'",
        "'fulll'",
        "duplicate rule name",
        "regular",
        "'default'",
    ):
        assert fragment in messages


def test_problem_text_is_file_line_column_severity_message_hint() -> None:
    with pytest.raises(RulesError) as info:
        load_rules("version: 1\ndefault: {mode: ful}\n", "/etc/drgate/rules.yaml")
    assert str(info.value) == (
        "/etc/drgate/rules.yaml:2:17: error: unknown mode 'ful' "
        "(hint: did you mean 'full'? valid: full, enqueue, wiring, none, from-args)"
    )


# (id, text, expected warnings as (line, column, message))
WARNINGS = [
    ("same-queue", """\
        version: 1
        rules:
          - name: a
            match: {queue: "orders.*"}
            action: {mode: full}
          - name: b
            match: {queue: orders.eu}
            action: {mode: none}
        default: {mode: none}
        """, [(6, 5, "rule 'b' can never match: rule 'a' (line 3) matches everything it matches")]),
    ("catch-all-shadows-default", """\
        version: 1
        rules:
          - name: all
            match: {}
            action: {mode: full}
        default: {mode: none}
        """, [(6, 10, "the default action is never used: rule 'all' (line 3) matches every queue")]),
    ("message-rule-covered-by-queue-rule", """\
        version: 1
        rules:
          - name: a
            match: {queue: t}
            action: {mode: wiring}
          - name: b
            match: {queue: t, headers: [{header: r, equals: eu}]}
            action: {mode: full}
        default: {mode: none}
        """, [(6, 5, "rule 'b' can never match: rule 'a' (line 3) matches everything it matches")]),
    ("topic-hash-covers", """\
        version: 1
        rules:
          - name: a
            match: {routing_key: "orders.#"}
            action: {mode: full}
          - name: b
            match: {routing_key: "orders.eu.new", queue: q}
            action: {mode: full}
        default: {mode: none}
        """, [(6, 5, "rule 'b' can never match: rule 'a' (line 3) matches everything it matches")]),
    ("queue-rule-after-message-rule-is-reachable", """\
        version: 1
        rules:
          - name: a
            match: {queue: t, headers: [{header: r, equals: eu}]}
            action: {mode: full}
          - name: b
            match: {queue: t}
            action: {mode: wiring}
        default: {mode: none}
        """, []),
    ("narrower-first-is-fine", """\
        version: 1
        rules:
          - name: a
            match: {queue: orders.eu}
            action: {mode: full}
          - name: b
            match: {queue: "orders.*"}
            action: {mode: none}
        default: {mode: none}
        """, []),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"), [pytest.param(*case[1:], id=case[0]) for case in WARNINGS]
)
def test_unreachable_rules_are_warnings(text: str, expected: list[tuple[int, int, str]]) -> None:
    ruleset = load_rules(textwrap.dedent(text), F)
    got = [(w.location.line, w.location.column, w.message) for w in ruleset.warnings]
    assert got == expected
    assert all(w.severity == "warning" for w in ruleset.warnings)


@pytest.mark.parametrize("path", sorted((ROOT / "deploy" / "rules").glob("*.yaml")), ids=str)
def test_shipped_example_rules_load_without_warnings(path: Path) -> None:
    ruleset = load_rules(path.read_text(encoding="utf-8"), str(path))
    assert ruleset.warnings == []
    assert ruleset.default.name == "default"


def test_shipped_examples_exist() -> None:
    names = {p.name for p in (ROOT / "deploy" / "rules").glob("*.yaml")}
    assert {"example.yaml", "mode-i-enqueue.yaml", "mode-ii-full.yaml"} <= names
    assert {"wiring-only.yaml", "per-header.yaml"} <= names


def test_digest_is_sha256_of_the_text() -> None:
    import hashlib

    text = "version: 1\ndefault: {mode: wiring}\n"
    ruleset = load_rules(text, F)
    assert ruleset.digest == hashlib.sha256(text.encode()).hexdigest()
    assert ruleset.default.action.mode is Mode.WIRING


# ------------------------------------------------------------------- fuzzing

VALID = (ROOT / "deploy" / "rules" / "example.yaml").read_text(encoding="utf-8")

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(
        ["full", "enqueue", "wiring", "none", "from-args", "q", "orders.*", "#", "(", "x-h"]
    ), st.text(max_size=5),
)  # fmt: skip
keys = st.sampled_from(
    ["version", "rules", "default", "name", "match", "action", "mode", "queue", "queue_regex",
     "exchange", "routing_key", "headers", "header", "equals", "exists", "in", "args", "target",
     "prefix", "fallback", "drop", "max_message_bytes", "bogus"]
)  # fmt: skip
documents = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=5)
    ),
    max_leaves=25,
)


def assert_ruleset_or_located_error(text: str) -> None:
    try:
        result = load_rules(text, F)
    except RulesError as exc:
        problems = exc.problems
    else:
        problems = []
        assert isinstance(result, RuleSet)
        result.decide_queue("orders.eu", {"qpid.replicate": "all"})
        result.decide_message("trades", None, "amq.topic", "a.b", {"region": "eu"}, 10)
        return
    assert problems
    for p in problems:
        assert p.location.file == F
        assert p.location.line >= 1
        assert p.location.column >= 1
        assert p.message


@given(documents)
def test_random_documents_give_a_ruleset_or_located_errors(doc: object) -> None:
    import yaml

    assert_ruleset_or_located_error(yaml.safe_dump(doc))


@given(st.dictionaries(keys, documents, max_size=4))
def test_random_top_level_mappings(doc: dict[str, object]) -> None:
    import yaml

    doc.setdefault("version", 1)
    assert_ruleset_or_located_error(yaml.safe_dump(doc))


@given(
    st.lists(
        st.tuples(
            st.integers(0, len(VALID)),
            st.integers(0, 8),
            st.text(alphabet=" \t\n:-[]{}'\"#*&!|>%@`,?x1", max_size=4),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_valid_file_gives_a_ruleset_or_located_errors(
    edits: list[tuple[int, int, str]],
) -> None:
    text = VALID
    for position, cut, insert in edits:
        at = min(position, len(text))
        text = text[:at] + insert + text[at + cut :]
    assert_ruleset_or_located_error(text)


@given(
    st.one_of(
        st.text(max_size=60),
        st.sampled_from(["!!timestamp x", "!!int 0xZZ", "!!binary A", "!!float y"]).map(
            lambda tagged: f"version: {tagged}\n"
        ),
    )
)
def test_arbitrary_text_gives_a_ruleset_or_located_errors(text: str) -> None:
    assert_ruleset_or_located_error(text)
