"""filters.yamldoc: values with locations, and the checking helpers."""

from __future__ import annotations

import pytest

from filters.yamldoc import (
    Problems,
    check_keys,
    expect_int,
    expect_str,
    expect_str_list,
    nearest_hint,
    parse,
)
from protocol.errors import ConfigError, Location


def test_nodes_carry_one_based_line_and_column() -> None:
    root = parse("a: 1\nb:\n  - x\n  - {c: true}\n", "f.yaml", error=ConfigError)
    assert root.plain() == {"a": 1, "b": ["x", {"c": True}]}
    assert root.keys["b"] == Location("f.yaml", 2, 1)
    assert root.value["a"].location == Location("f.yaml", 1, 4)
    inner = root.value["b"].value[1]
    assert inner.location == Location("f.yaml", 4, 5)
    assert inner.keys["c"] == Location("f.yaml", 4, 6)


def test_aliases_share_values() -> None:
    root = parse("a: &x [1, 2]\nb: *x\n", "f", error=ConfigError)
    assert root.plain() == {"a": [1, 2], "b": [1, 2]}


def test_parse_raises_the_error_class_it_is_given() -> None:
    with pytest.raises(ConfigError) as info:
        parse("a: [\n", "broker.yaml", error=ConfigError)
    assert str(info.value.problems[0].location) == "broker.yaml:2:1"


def test_check_keys_reports_unknown_and_missing() -> None:
    problems = Problems()
    root = parse("linger_m: 5\n", "c.yaml", error=ConfigError)
    fields = check_keys(
        root, problems, what="the link section", required=("peer",), optional=("linger_ms",)
    )
    assert fields == {}
    assert [str(p) for p in problems.items] == [
        "c.yaml:1:1: error: unknown key 'linger_m' in the link section "
        "(hint: did you mean 'linger_ms'? valid: peer, linger_ms)",
        "c.yaml:1:1: error: missing key 'peer' in the link section",
    ]
    with pytest.raises(ConfigError):
        problems.raise_if_any(ConfigError)


def test_typed_expectations() -> None:
    problems = Problems()
    root = parse("n: x\ns: 3\nl: [a, '']\nm: -1\n", "t.yaml", error=ConfigError)
    v = root.value
    assert expect_int(v["n"], problems, what="'n'") is None
    assert expect_str(v["s"], problems, what="'s'") is None
    assert expect_str_list(v["l"], problems, what="'l'") is None
    assert expect_int(v["m"], problems, what="'m'", minimum=0) is None
    assert [(p.location.line, p.location.column, p.message) for p in problems.items] == [
        (1, 4, "'n' must be an integer, got a string"),
        (2, 4, "'s' must be a string, got an integer"),
        (3, 8, "each item of 'l' must not be empty"),
        (4, 4, "'m' must be at least 0, got -1"),
    ]


def test_warnings_do_not_raise() -> None:
    problems = Problems()
    problems.warning(Location("w", 1, 1), "careful")
    problems.raise_if_any(ConfigError)
    assert [p.severity for p in problems.warnings] == ["warning"]


def test_nearest_hint_without_a_close_word_lists_valid_ones() -> None:
    assert nearest_hint("zzz", ["alpha", "beta"]) == "valid: alpha, beta"
