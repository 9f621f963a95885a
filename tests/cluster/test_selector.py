"""JMS selectors (cluster/selector.py): grammar, three-valued logic, errors."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.selector import MAX_DEPTH, MAX_SELECTOR_CHARS, SelectorError, parse_selector

MESSAGE: dict[str, Any] = {
    "color": "red",
    "weight": 15,
    "price": 2.5,
    "name": "ab_c%d",
    "flag": True,
    "off": False,
    "region": "eu",
    "a.b": "dotted",
    "it's": "quoted",
}


def evaluate(text: str, message: dict[str, Any] | None = None) -> bool | None:
    return parse_selector(text).evaluate((MESSAGE if message is None else message).get)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # comparisons
        ("color = 'red'", True),
        ("color = 'blue'", False),
        ("color <> 'blue'", True),
        ("weight = 15", True),
        ("weight <> 15", False),
        ("weight < 16", True),
        ("weight <= 15", True),
        ("weight > 15", False),
        ("weight >= 15", True),
        ("price > 2", True),
        ("price = 2.5", True),
        ("weight = 15.0", True),
        ("weight > 1e1", True),
        ("weight = 0xF", True),
        ("weight = 15L", True),
        ("price < .3E1", True),
        ("flag = TRUE", True),
        ("flag", True),
        ("off", False),
        ("flag <> off", True),
        # JMS: unlike types compare false; strings and booleans only = and <>
        ("weight = '15'", False),
        ("color > 'a'", False),
        ("flag = 1", False),
        ("flag < TRUE", False),
        # arithmetic
        ("weight * 2 + 1 = 31", True),
        ("weight - 20 = -5", True),
        ("weight / 2 = 7", True),  # integer division, as Java
        ("-weight / 2 = -7", True),
        ("price / 2 = 1.25", True),
        ("weight / 0 = 1", None),
        ("color + 1 = 1", None),
        ("+weight = 15", True),
        ("1" + "0" * 400 + " + 0.5 > 1", None),  # too large to mix with a float: no value
        ("1" + "0" * 400 + " > 1.5", True),
        ("(weight + 1) * 2 = 32", True),
        ("weight + 1 * 2 = 17", True),
        # logic
        ("color = 'red' AND weight = 15", True),
        ("color = 'red' AND weight = 16", False),
        ("color = 'blue' OR weight = 15", True),
        ("NOT color = 'blue'", True),
        ("NOT (color = 'red' AND weight = 15)", False),
        ("color = 'blue' OR color = 'red' AND weight = 16", False),  # AND binds tighter
        ("(color = 'blue' OR color = 'red') AND weight = 15", True),
        ("not color = 'blue' and WEIGHT_MISSING is null", True),  # keywords in any case
        # IN
        ("color IN ('red', 'blue')", True),
        ("color IN ('green')", False),
        ("color NOT IN ('green', 'blue')", True),
        ("weight IN (14, 15)", True),
        ("missing IN ('a')", None),
        ("missing NOT IN ('a')", None),
        # LIKE
        ("name LIKE 'ab%'", True),
        ("name LIKE 'a_\\_c%' ESCAPE '\\'", True),
        ("name LIKE 'a__c%'", True),
        ("name LIKE 'ab!_c!%d' ESCAPE '!'", True),
        ("name LIKE 'ab!_c!%' ESCAPE '!'", False),
        ("name NOT LIKE 'x%'", True),
        ("color LIKE 'RED'", False),  # case-sensitive
        ("weight LIKE '15'", False),
        ("missing LIKE 'a%'", None),
        ("missing NOT LIKE 'a%'", None),
        # IS NULL
        ("missing IS NULL", True),
        ("missing IS NOT NULL", False),
        ("color IS NULL", False),
        ("color IS NOT NULL", True),
        # BETWEEN
        ("weight BETWEEN 10 AND 20", True),
        ("weight BETWEEN 15 AND 15", True),
        ("weight BETWEEN 16 AND 20", False),
        ("weight NOT BETWEEN 16 AND 20", True),
        ("missing BETWEEN 1 AND 2", None),
        ("weight BETWEEN missing AND 20", None),
        ("weight BETWEEN 20 AND missing", False),  # FALSE AND UNKNOWN
        # NULL in comparisons is UNKNOWN
        ("missing = 1", None),
        ("NOT missing = 1", None),
        ("missing = 1 OR color = 'red'", True),
        ("missing = 1 AND color = 'blue'", False),
        ("missing = 1 AND color = 'red'", None),
        ("missing = 1 OR color = 'blue'", None),
        ("NULL IS NULL", True),
        # names: dotted, quoted, strings with quotes
        ("a.b = 'dotted'", True),
        ("\"it's\" = 'quoted'", True),
        ("color = 'r''ed'", False),
        ("'it''s' = 'it''s'", True),
    ],
)
def test_a_selector_evaluates_as_sql_does(text: str, expected: bool | None) -> None:
    assert evaluate(text) is expected


def test_a_message_is_selected_only_when_the_selector_is_true() -> None:
    assert parse_selector("color = 'red'").matches(MESSAGE.get)
    assert not parse_selector("color = 'blue'").matches(MESSAGE.get)
    assert not parse_selector("missing = 1").matches(MESSAGE.get)  # UNKNOWN
    assert not parse_selector("weight").matches(MESSAGE.get)  # not a boolean


def test_a_selector_names_the_identifiers_it_reads() -> None:
    selector = parse_selector("color = 'red' AND (JMSPriority > 4 OR \"x y\" IS NULL)")
    assert selector.identifiers == frozenset({"color", "JMSPriority", "x y"})


@pytest.mark.parametrize(
    ("text", "position", "reason"),
    [
        ("", 1, "expected an expression, found end of selector"),
        ("color = ", 9, "expected a value"),
        ("color = 'red", 9, "string literal is not closed"),
        ('"color = 1', 1, "quoted identifier is not closed"),
        ("color == 'red'", 8, "expected a value"),
        ("(color = 'red'", 15, "expected ), found end of selector"),
        ("color = 'red' blue", 15, "expected AND, OR or the end of the selector, found 'blue'"),
        ("color # 1", 7, "unexpected character '#'"),
        ("12abc = 1", 3, "unexpected character 'a' after number"),
        ("color LIKE 3", 12, "expected a string pattern after LIKE"),
        ("color LIKE 'a' ESCAPE 'ab'", 23, "one-character string after ESCAPE"),
        ("color LIKE 'a!' ESCAPE '!'", 12, "ends with its escape character"),
        ("color IN ()", 11, "expected a literal in the IN list"),
        ("color IN ('a' 'b')", 15, "expected , or ) in the IN list"),
        ("color IN 'a'", 10, "expected ( after IN"),
        ("color IS 1", 10, "expected NULL or NOT NULL"),
        ("color IS NOT 1", 14, "expected NULL, found '1'"),
        ("color NOT 1", 11, "expected BETWEEN, IN or LIKE after NOT"),
        ("weight BETWEEN 1 OR 2", 18, "expected AND (BETWEEN low AND high)"),
        ("AND", 1, "expected a value"),
    ],
)
def test_a_malformed_selector_names_the_position_and_what_was_expected(
    text: str, position: int, reason: str
) -> None:
    with pytest.raises(SelectorError) as raised:
        parse_selector(text)
    assert raised.value.position == position
    assert reason in raised.value.reason
    assert str(raised.value).startswith(f"selector {text!r}: at position {position}: ")


def test_a_selector_nested_too_deep_or_too_long_is_refused_not_a_crash() -> None:
    deep = "(" * (MAX_DEPTH + 1) + "a = 1" + ")" * (MAX_DEPTH + 1)
    with pytest.raises(SelectorError, match="nested more than"):
        parse_selector(deep)
    assert parse_selector("(" * 10 + "a = 1" + ")" * 10).evaluate({"a": 1}.get) is True
    deep_not = "NOT " * (MAX_DEPTH + 1) + "a = 1"
    with pytest.raises(SelectorError, match="nested more than"):
        parse_selector(deep_not)
    with pytest.raises(SelectorError, match=f"longer than {MAX_SELECTOR_CHARS}"):
        parse_selector("a = 1 OR " * 1000 + "a = 1")


def test_like_takes_linear_steps_on_a_pattern_that_would_make_a_regex_backtrack() -> None:
    # As a regular expression (.*a.*a...b) this takes longer than any test
    # run; every broker's applier evaluates selectors, so it must not.
    selector = parse_selector("v LIKE '" + "%a" * 12 + "%b'")
    assert selector.evaluate({"v": "a" * 2000}.get) is False
    assert selector.evaluate({"v": "a" * 2000 + "b"}.get) is True


def test_a_long_chain_of_terms_evaluates_without_exhausting_the_stack() -> None:
    # 500 ORs and a sum of 1500 terms: folded in a loop, not nested (as
    # nested closures they would pass Python's recursion limit).
    ors = " OR ".join(["w=1"] * 500)
    assert len(ors) < MAX_SELECTOR_CHARS
    assert parse_selector(ors).evaluate({"w": 2}.get) is False
    total = "+".join(["w"] * 1500) + "=1500"
    assert len(total) < MAX_SELECTOR_CHARS
    assert parse_selector(total).evaluate({"w": 1}.get) is True


# --------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------

truth = st.sampled_from([True, False, None])


def sql_and(a: bool | None, b: bool | None) -> bool | None:
    if a is False or b is False:
        return False
    return None if a is None or b is None else True


def sql_or(a: bool | None, b: bool | None) -> bool | None:
    if a is True or b is True:
        return True
    return None if a is None or b is None else False


def sql_not(a: bool | None) -> bool | None:
    return None if a is None else not a


@given(truth, truth)
def test_and_or_not_follow_the_sql_truth_tables(p: bool | None, q: bool | None) -> None:
    message = {"p": p, "q": q}
    assert evaluate("p AND q", message) is sql_and(p, q)
    assert evaluate("p OR q", message) is sql_or(p, q)
    assert evaluate("NOT p", message) is sql_not(p)
    # De Morgan holds in three-valued logic too.
    assert evaluate("NOT (p AND q)", message) is evaluate("NOT p OR NOT q", message)
    assert evaluate("NOT (p OR q)", message) is evaluate("NOT p AND NOT q", message)


numbers = st.one_of(
    st.integers(-(10**12), 10**12), st.floats(-1e12, 1e12, allow_nan=False, allow_infinity=False)
)


@given(numbers, numbers)
def test_numeric_comparisons_agree_with_arithmetic(a: float, b: float) -> None:
    message = {"a": a, "b": b}
    assert evaluate("a = b", message) is (a == b)
    assert evaluate("a <> b", message) is (a != b)
    assert evaluate("a < b", message) is (a < b)
    assert evaluate("a <= b", message) is (a <= b)
    assert evaluate("a > b", message) is (a > b)
    assert evaluate("a >= b", message) is (a >= b)
    assert evaluate("a BETWEEN b AND b", message) is (a == b)
    assert evaluate(f"a = {a!r}", message) is True


def like_reference(value: str, pattern: str) -> bool:
    """SQL LIKE by dynamic programming (no regular expressions)."""
    n, m = len(value), len(pattern)
    table = [[False] * (m + 1) for _ in range(n + 1)]
    table[0][0] = True
    for j in range(1, m + 1):
        table[0][j] = table[0][j - 1] and pattern[j - 1] == "%"
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            c = pattern[j - 1]
            if c == "%":
                table[i][j] = table[i][j - 1] or table[i - 1][j]
            else:
                table[i][j] = table[i - 1][j - 1] and c in ("_", value[i - 1])
    return table[n][m]


@given(st.text("ab.*\n", max_size=8), st.text("ab.*\n%_", max_size=8))
def test_like_matches_as_sql_does(value: str, pattern: str) -> None:
    literal = pattern.replace("'", "''")
    assert evaluate(f"v LIKE '{literal}'", {"v": value}) is like_reference(value, pattern)
    assert evaluate(f"v NOT LIKE '{literal}'", {"v": value}) is not like_reference(value, pattern)


@given(st.text(max_size=40))
def test_any_text_parses_or_is_refused_with_a_position_in_it(text: str) -> None:
    error: SelectorError | None = None
    try:
        selector = parse_selector(text)
    except SelectorError as exc:
        error = exc
    if error is not None:
        assert 1 <= error.position <= len(text) + 1
    else:
        assert selector.evaluate({}.get) in (True, False, None)


selector_atoms = st.sampled_from(
    [
        "color = 'red'",
        "weight > 10",
        "missing IS NULL",
        "name LIKE 'a%'",
        "region IN ('eu', 'us')",
        "weight BETWEEN 1 AND 20",
        "missing = 3",
        "flag",
    ]
)


@st.composite
def selectors(draw: st.DrawFn, depth: int = 3) -> str:
    if depth == 0 or draw(st.booleans()):
        return draw(selector_atoms)
    op = draw(st.sampled_from(["AND", "OR", "NOT"]))
    if op == "NOT":
        return f"NOT ({draw(selectors(depth - 1))})"
    return f"({draw(selectors(depth - 1))}) {op} ({draw(selectors(depth - 1))})"


@given(selectors())
def test_composed_selectors_parse_and_agree_with_their_negation(text: str) -> None:
    value = evaluate(text)
    assert evaluate(f"NOT ({text})") is sql_not(value)
    # The same text with keywords in lower case means the same.
    lowered = re.sub(r"\b(AND|OR|NOT|IN|LIKE|IS|NULL|BETWEEN)\b", lambda m: m[0].lower(), text)
    assert evaluate(lowered) is value


vocabulary = st.sampled_from(
    [
        "a", "b", "c", "1", "2.5", "0", "1e308", "9" * 30, "9" * 400, "'x'", "''", "TRUE", "NULL",
        "=", "<>", "<", ">=", "+", "-", "*", "/", "(", ")", ",",
        "AND", "OR", "NOT", "IN", "LIKE", "ESCAPE", "IS", "BETWEEN", "'%x_'", "'!'",
    ]
)  # fmt: skip
property_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=5),
)


@given(
    st.lists(vocabulary, min_size=1, max_size=14),
    st.dictionaries(st.sampled_from("abc"), property_values),
)
def test_whatever_parses_evaluates_to_true_false_or_unknown_and_never_raises(
    words: list[str], message: dict[str, Any]
) -> None:
    # Every broker's applier evaluates selectors: an exception there would
    # stop the site, so no input may raise.
    try:
        selector = parse_selector(" ".join(words))
    except SelectorError:
        return
    assert selector.evaluate(message.get) in (True, False, None)
