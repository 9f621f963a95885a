"""JMS message selectors: the ``jms-selector`` filter of an AMQP 1.0 source.

Theory of operation
-------------------
A selector is a boolean expression over a message's header fields and
application properties, in the SQL-92 subset of the JMS specification
(section 3.8.1), as Qpid and Artemis accept it::

    color = 'red' AND weight BETWEEN 10 AND 20 AND NOT (region IN ('eu', 'us'))
    name LIKE 'ab\\_%' ESCAPE '\\' OR JMSPriority > 4 OR code IS NULL

:func:`parse_selector` turns the text into a :class:`Selector` (tokenizer,
then a recursive-descent parser that compiles each node into a closure) or
raises :class:`SelectorError` naming the selector and the 1-based position
of the mistake.  :meth:`Selector.evaluate` runs it against a *lookup*, a
function from an identifier to its value (``None`` when the message has no
such field), with SQL's three-valued logic: a comparison involving NULL is
UNKNOWN (``None``), ``NOT UNKNOWN`` is UNKNOWN, ``FALSE AND UNKNOWN`` is
FALSE, ``TRUE OR UNKNOWN`` is TRUE.  A message is selected only when the
selector is TRUE.  Comparing values of different types (a string with a
number, a boolean with anything but a boolean) is FALSE, as JMS says;
strings and booleans compare only with ``=`` and ``<>``.

This module is pure: no I/O, no clock, no Proton.  The broker binds
identifiers to a stored message in :mod:`cluster.state.selection`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import DrgateError

__all__ = ["MAX_SELECTOR_CHARS", "Lookup", "Selector", "SelectorError", "parse_selector"]

# A selector longer than this is refused: it travels in every acquire on
# the bus (a u16-length string), and no real selector comes close.
MAX_SELECTOR_CHARS = 4096
# Nesting deeper than this is refused rather than overflowing the stack.
MAX_DEPTH = 64

Lookup = Callable[[str], Any]
"""Identifier -> value: ``None`` (absent), bool, int, float or str."""

# What an expression evaluates to: None is SQL's NULL / UNKNOWN.
_Eval = Callable[[Lookup], Any]


class SelectorError(DrgateError):
    """A selector that does not parse.  ``position`` is 1-based."""

    def __init__(self, text: str, position: int, reason: str) -> None:
        self.text = text
        self.position = position
        self.reason = reason
        super().__init__(f"selector {text!r}: at position {position}: {reason}")


@dataclass(frozen=True, slots=True)
class Selector:
    """A parsed selector.  ``identifiers``: every name it reads."""

    text: str
    identifiers: frozenset[str]
    _evaluate: _Eval = field(repr=False, compare=False)

    def evaluate(self, lookup: Lookup) -> bool | None:
        """TRUE, FALSE or UNKNOWN (``None``) for the message ``lookup`` reads."""
        value = self._evaluate(lookup)
        return value if isinstance(value, bool) else None

    def matches(self, lookup: Lookup) -> bool:
        """The message is selected: the selector is TRUE for it."""
        return self._evaluate(lookup) is True


# --------------------------------------------------------------------------
# Tokens
# --------------------------------------------------------------------------

_KEYWORDS = frozenset(
    {"AND", "OR", "NOT", "IN", "LIKE", "ESCAPE", "IS", "NULL", "BETWEEN", "TRUE", "FALSE"}
)

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<hex>0[xX][0-9a-fA-F]+[lL]?)
  | (?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[lLfFdD]?)
  | (?P<string>'(?:[^']|'')*')
  | (?P<quoted>"(?:[^"]|"")*")
  | (?P<name>[A-Za-z_$][A-Za-z0-9_$.]*)
  | (?P<op><>|<=|>=|[=<>(),+\-*/])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # "number", "string", "name", "keyword", "op", "end"
    value: Any
    position: int  # 1-based
    text: str


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    i = 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            if text[i] == "'":
                raise SelectorError(text, i + 1, "string literal is not closed (missing ')")
            if text[i] == '"':
                raise SelectorError(text, i + 1, 'quoted identifier is not closed (missing ")')
            raise SelectorError(text, i + 1, f"unexpected character {text[i]!r}")
        kind = m.lastgroup
        raw = m.group()
        pos = i + 1
        i = m.end()
        if kind == "space":
            continue
        if kind == "hex":
            tokens.append(_Token("number", int(raw.rstrip("lL"), 16), pos, raw))
        elif kind == "number":
            tokens.append(_Token("number", _number(raw), pos, raw))
        elif kind == "string":
            tokens.append(_Token("string", raw[1:-1].replace("''", "'"), pos, raw))
        elif kind == "quoted":
            tokens.append(_Token("name", raw[1:-1].replace('""', '"'), pos, raw))
        elif kind == "name" and raw.upper() in _KEYWORDS:
            tokens.append(_Token("keyword", raw.upper(), pos, raw))
        else:
            assert kind in ("name", "op")
            tokens.append(_Token(kind, raw, pos, raw))
        if kind in ("hex", "number") and i < len(text) and (text[i].isalnum() or text[i] == "_"):
            raise SelectorError(text, i + 1, f"unexpected character {text[i]!r} after number")
    tokens.append(_Token("end", None, len(text) + 1, "end of selector"))
    return tokens


def _number(raw: str) -> int | float:
    body = raw.rstrip("lLfFdD")
    if raw[-1] in "lL" or (raw[-1] not in "fFdD" and re.fullmatch(r"\d+", body)):
        return int(body)
    return float(body)


# --------------------------------------------------------------------------
# Evaluation helpers (three-valued)
# --------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _compare(op: str, a: Any, b: Any) -> bool | None:
    if a is None or b is None:
        return None
    if _is_number(a) and _is_number(b):
        if op == "=":
            return bool(a == b)
        if op == "<>":
            return bool(a != b)
        if op == "<":
            return bool(a < b)
        if op == "<=":
            return bool(a <= b)
        if op == ">":
            return bool(a > b)
        return bool(a >= b)
    same = (isinstance(a, str) and isinstance(b, str)) or (
        isinstance(a, bool) and isinstance(b, bool)
    )
    if not same or op not in ("=", "<>"):
        return False  # JMS: comparing unlike types (or ordering strings) is false
    return bool(a == b) if op == "=" else bool(a != b)


def _not(a: Any) -> bool | None:
    return None if not isinstance(a, bool) else not a


def _and(a: Any, b: Any) -> bool | None:
    if a is False or b is False:
        return False
    if a is True and b is True:
        return True
    return None


def _or(a: Any, b: Any) -> bool | None:
    return _not(_and(_not(a), _not(b)))  # De Morgan holds in three-valued logic


def _arithmetic(op: str, a: Any, b: Any) -> Any:
    if not (_is_number(a) and _is_number(b)):
        return None
    try:
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if b == 0:
            return None  # no value: the comparison around it is UNKNOWN
        if isinstance(a, int) and isinstance(b, int):
            q = abs(a) // abs(b)
            return q if (a >= 0) == (b >= 0) else -q  # Java's integer division
        return a / b
    except OverflowError:  # an integer too large to mix with a float
        return None


# A LIKE pattern, compiled: one entry per pattern character, ``_ANY_ONE``
# for ``_``, ``_ANY_RUN`` for ``%``, else the literal character.
_ANY_ONE = object()
_ANY_RUN = object()


def _like_pattern(text: str, token: _Token, pattern: str, escape: str | None) -> list[object]:
    out: list[object] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if escape is not None and c == escape:
            if i + 1 >= len(pattern):
                raise SelectorError(
                    text, token.position, f"LIKE pattern {pattern!r} ends with its escape character"
                )
            out.append(pattern[i + 1])
            i += 2
            continue
        if c == "%":
            if not out or out[-1] is not _ANY_RUN:  # %% is %
                out.append(_ANY_RUN)
        else:
            out.append(_ANY_ONE if c == "_" else c)
        i += 1
    return out


def _like(value: str, pattern: list[object]) -> bool:
    """``value`` matches the compiled LIKE ``pattern``: the two-pointer
    wildcard match, at most len(value) * len(pattern) steps (a regular
    expression would backtrack exponentially on ``%a%a%a%b``, and every
    broker of the site evaluates selectors in its applier)."""
    v = p = 0
    run = -1  # the pattern index just after the last %, and where in value it began
    run_v = 0
    while v < len(value):
        if (
            p < len(pattern)
            and pattern[p] is not _ANY_RUN
            and (pattern[p] is _ANY_ONE or pattern[p] == value[v])
        ):
            v += 1
            p += 1
        elif p < len(pattern) and pattern[p] is _ANY_RUN:
            run = p + 1
            run_v = v
            p += 1
        elif run >= 0:
            run_v += 1  # let the last % take one more character
            v = run_v
            p = run
        else:
            return False
    while p < len(pattern) and pattern[p] is _ANY_RUN:
        p += 1
    return p == len(pattern)


# --------------------------------------------------------------------------
# Parser: recursive descent, each rule returns a closure
# --------------------------------------------------------------------------

_COMPARISONS = frozenset({"=", "<>", "<", "<=", ">", ">="})


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0
        self.depth = 0
        self.identifiers: set[str] = set()

    # -- token helpers --

    @property
    def tok(self) -> _Token:
        return self.tokens[self.i]

    def at(self, kind: str, value: Any = None) -> bool:
        t = self.tok
        return t.kind == kind and (value is None or t.value == value)

    def take(self, kind: str, value: Any = None) -> bool:
        if self.at(kind, value):
            self.i += 1
            return True
        return False

    def fail(self, expected: str) -> SelectorError:
        t = self.tok
        found = t.text if t.kind == "end" else repr(t.text)
        return SelectorError(self.text, t.position, f"expected {expected}, found {found}")

    def expect(self, kind: str, value: Any, expected: str) -> None:
        if not self.take(kind, value):
            raise self.fail(expected)

    # -- grammar --

    def parse(self) -> _Eval:
        if self.at("end"):
            raise self.fail("an expression")
        fn = self.or_expr()
        if not self.at("end"):
            raise self.fail("AND, OR or the end of the selector")
        return fn

    # Chains (a OR b OR c, a + b - c) are folded in a loop, never nested
    # closures, so that a long selector cannot exhaust the stack.

    def or_expr(self) -> _Eval:
        return self.logical("OR", self.and_expr, _or, True)

    def and_expr(self) -> _Eval:
        return self.logical("AND", self.not_expr, _and, False)

    def logical(
        self,
        keyword: str,
        operand: Callable[[], _Eval],
        combine: Callable[[Any, Any], bool | None],
        decided: bool,
    ) -> _Eval:
        """``operand (keyword operand)*``; ``decided`` ends the evaluation
        (TRUE for OR, FALSE for AND)."""
        terms = [operand()]
        while self.take("keyword", keyword):
            terms.append(operand())
        if len(terms) == 1:
            return terms[0]

        def fold(m: Lookup) -> bool | None:
            result: bool | None = not decided
            for term in terms:
                result = combine(result, term(m))
                if result is decided:
                    break
            return result

        return fold

    def not_expr(self) -> _Eval:
        if self.take("keyword", "NOT"):
            inner = self.nested(self.not_expr)
            return lambda m: _not(inner(m))
        return self.predicate()

    def nested(self, rule: Callable[[], _Eval]) -> _Eval:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise SelectorError(
                self.text, self.tok.position, f"nested more than {MAX_DEPTH} deep; simplify it"
            )
        try:
            return rule()
        finally:
            self.depth -= 1

    def predicate(self) -> _Eval:
        left = self.additive()
        t = self.tok
        if t.kind == "op" and t.value in _COMPARISONS:
            self.i += 1
            right = self.additive()
            op = t.value
            return lambda m: _compare(op, left(m), right(m))
        if self.take("keyword", "IS"):
            negate = self.take("keyword", "NOT")
            self.expect("keyword", "NULL", "NULL" if negate else "NULL or NOT NULL")
            if negate:
                return lambda m: left(m) is not None
            return lambda m: left(m) is None
        negate = self.take("keyword", "NOT")
        if self.take("keyword", "BETWEEN"):
            low = self.additive()
            self.expect("keyword", "AND", "AND (BETWEEN low AND high)")
            high = self.additive()

            def between(m: Lookup) -> bool | None:
                v = left(m)
                return _and(_compare(">=", v, low(m)), _compare("<=", v, high(m)))

            return (lambda m: _not(between(m))) if negate else between
        if self.take("keyword", "IN"):
            return self.in_list(left, negate)
        if self.take("keyword", "LIKE"):
            return self.like(left, negate)
        if negate:
            raise self.fail("BETWEEN, IN or LIKE after NOT")
        return left

    def in_list(self, left: _Eval, negate: bool) -> _Eval:
        self.expect("op", "(", "( after IN")
        values: list[Any] = []
        while True:
            t = self.tok
            if t.kind in ("string", "number"):
                values.append(t.value)
                self.i += 1
            elif t.kind == "keyword" and t.value in ("TRUE", "FALSE"):
                values.append(t.value == "TRUE")
                self.i += 1
            else:
                raise self.fail("a literal in the IN list")
            if self.take("op", ")"):
                break
            self.expect("op", ",", ", or ) in the IN list")

        def contained(m: Lookup) -> bool | None:
            v = left(m)
            if v is None:
                return None
            return any(_compare("=", v, x) for x in values)

        return (lambda m: _not(contained(m))) if negate else contained

    def like(self, left: _Eval, negate: bool) -> _Eval:
        t = self.tok
        if t.kind != "string":
            raise self.fail("a string pattern after LIKE")
        self.i += 1
        escape: str | None = None
        if self.take("keyword", "ESCAPE"):
            e = self.tok
            if e.kind != "string" or len(e.value) != 1:
                raise self.fail("a one-character string after ESCAPE")
            escape = e.value
            self.i += 1
        compiled = _like_pattern(self.text, t, t.value, escape)

        def like(m: Lookup) -> bool | None:
            v = left(m)
            if v is None:
                return None
            if not isinstance(v, str):
                return False
            return _like(v, compiled)

        return (lambda m: _not(like(m))) if negate else like

    def additive(self) -> _Eval:
        return self.chain(self.multiplicative, "+", "-")

    def multiplicative(self) -> _Eval:
        return self.chain(self.unary, "*", "/")

    def chain(self, operand: Callable[[], _Eval], *ops: str) -> _Eval:
        first = operand()
        rest: list[tuple[str, _Eval]] = []
        while self.tok.kind == "op" and self.tok.value in ops:
            op = self.tok.value
            self.i += 1
            rest.append((op, operand()))
        if not rest:
            return first

        def fold(m: Lookup) -> Any:
            value = first(m)
            for op, fn in rest:
                value = _arithmetic(op, value, fn(m))
            return value

        return fold

    def unary(self) -> _Eval:
        if self.take("op", "-"):
            inner = self.nested(self.unary)
            return lambda m: _arithmetic("-", 0, inner(m))
        if self.take("op", "+"):
            inner = self.nested(self.unary)
            return lambda m: _arithmetic("+", 0, inner(m))
        return self.primary()

    def primary(self) -> _Eval:
        t = self.tok
        if t.kind in ("number", "string"):
            self.i += 1
            value = t.value
            return lambda m: value
        if t.kind == "keyword" and t.value in ("TRUE", "FALSE"):
            self.i += 1
            flag = t.value == "TRUE"
            return lambda m: flag
        if t.kind == "keyword" and t.value == "NULL":
            self.i += 1
            return lambda m: None
        if t.kind == "name":
            self.i += 1
            name = t.value
            self.identifiers.add(name)
            return lambda m: m(name)
        if self.take("op", "("):
            inner = self.nested(self.or_expr)
            self.expect("op", ")", ")")
            return inner
        raise self.fail("a value (a literal, an identifier or a parenthesis)")


def parse_selector(text: str) -> Selector:
    """Parse ``text``.  Raises :class:`SelectorError` (naming the selector,
    the position and what was expected) when it is not a selector."""
    if len(text) > MAX_SELECTOR_CHARS:
        raise SelectorError(
            text[:40] + "...",
            MAX_SELECTOR_CHARS + 1,
            f"longer than {MAX_SELECTOR_CHARS} characters",
        )
    parser = _Parser(text)
    fn = parser.parse()
    return Selector(text, frozenset(parser.identifiers), fn)
