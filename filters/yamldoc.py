"""YAML text -> plain values that remember where they came from.

Shared by the rules loader (:mod:`filters.rules`) and the broker and sidecar
config loaders in ``gateway/``.  Theory of operation:

1. :func:`parse` runs PyYAML's *composer* only (``yaml.compose``, with the C
   loader when it is available), never a constructor that could build
   arbitrary objects.  Every node is turned into a :class:`Node`: a plain value
   plus a :class:`~protocol.errors.Location` (file, 1-based line and column).
   Mappings keep their keys' locations too, so that "unknown key" points at
   the key and "wrong type" points at the value.
2. Anything wrong with the *text* (syntax error, duplicate key, non-string
   key, unsupported tag, recursive alias, an empty file) becomes a
   :class:`~protocol.errors.Problem` with its location; :func:`parse` raises
   the ``error`` class it is given (``RulesError`` or ``ConfigError``) with
   every problem found, never a PyYAML traceback.
3. The checking helpers (:class:`Problems`, :func:`check_keys`,
   :func:`expect_str` ...) let a loader walk the tree, record *every*
   mistake and carry on, then raise once with the whole list.

Node values:

* mapping: ``dict[str, Node]`` (insertion order kept), ``Node.keys`` holds
  the key locations;
* sequence: ``list[Node]``;
* scalar: ``str``, ``int``, ``float``, ``bool``, ``None`` (or ``bytes`` /
  ``datetime`` for ``!!binary`` / timestamps, which type checks reject
  where a string or a number is wanted).

:meth:`Node.plain` strips the locations for code that wants plain data.
Typical use::

    problems = Problems()
    root = parse(text, "rules.yaml", error=RulesError)
    fields = check_keys(root, problems, what="the rules file",
                        required=("version",), optional=("rules",))
    if fields is not None and "version" in fields:
        version = expect_int(fields["version"], problems, what="'version'")
    problems.raise_if_any(RulesError)
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import yaml

from protocol.errors import FileProblemsError, Location, Problem

__all__ = [
    "Node",
    "Problems",
    "check_keys",
    "describe",
    "expect_bool",
    "expect_int",
    "expect_list",
    "expect_mapping",
    "expect_scalar",
    "expect_str",
    "expect_str_list",
    "nearest_hint",
    "parse",
]

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# Deeper nesting than this is certainly a mistake (or an attack); stopping
# here keeps the walk far from Python's recursion limit.
MAX_DEPTH = 64

Kind = Literal["mapping", "sequence", "scalar"]
E = TypeVar("E", bound=FileProblemsError)


@dataclass(frozen=True, slots=True, eq=False)
class Node:
    """One YAML value and where it starts.

    ``keys`` maps each key of a mapping to the location of the key itself
    (empty for sequences and scalars).
    """

    kind: Kind
    value: Any
    location: Location
    keys: dict[str, Location] = field(default_factory=dict)

    @property
    def line(self) -> int:
        return self.location.line

    def plain(self) -> Any:
        """The value without locations: dicts, lists and scalars."""
        if self.kind == "mapping":
            return {k: v.plain() for k, v in self.value.items()}
        if self.kind == "sequence":
            return [v.plain() for v in self.value]
        return self.value


class Problems:
    """Collects :class:`Problem` objects while a loader walks a document."""

    def __init__(self) -> None:
        self.items: list[Problem] = []

    def error(self, location: Location, message: str, hint: str = "") -> None:
        self.items.append(Problem(location, message, hint))

    def warning(self, location: Location, message: str, hint: str = "") -> None:
        self.items.append(Problem(location, message, hint, severity="warning"))

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.items if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.items if p.severity != "error"]

    def raise_if_any(self, error: type[E]) -> None:
        """Raise ``error(errors)`` (sorted by place) if any error was recorded."""
        errors = self.errors
        if errors:
            raise error(sorted_problems(errors))


def sorted_problems(problems: Iterable[Problem]) -> list[Problem]:
    """Problems in file order (stable for equal locations)."""
    return sorted(problems, key=lambda p: (p.location.line, p.location.column))


# --------------------------------------------------------------------- parsing


def parse(text: str, path: str, *, error: type[E]) -> Node:
    """Parse one YAML document into a :class:`Node` tree.

    Raises ``error(problems)`` (a :class:`FileProblemsError` subclass) for a
    syntax error, an empty document, several documents, a duplicate or
    non-string key, an unsupported tag, a recursive alias or nesting deeper
    than :data:`MAX_DEPTH`.  Nothing else escapes.
    """
    problems = Problems()
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        loc = _mark_location(path, mark) if mark is not None else Location(path, 1, 1)
        message = ", ".join(s for s in (exc.context, exc.problem) if s) or "invalid YAML"
        at_tab = mark is not None and text[int(mark.index) : int(mark.index) + 1] == "\t"
        problems.error(loc, f"YAML syntax error: {message}", _syntax_hint(message, at_tab))
        problems.raise_if_any(error)
        raise AssertionError("unreachable") from None  # pragma: no cover
    except yaml.reader.ReaderError as exc:
        loc = _position_location(path, text, exc.position)
        problems.error(
            loc,
            f"YAML syntax error: {exc.reason} (character {exc.character!r})",
            "remove the character or quote it as an escape in a double-quoted string",
        )
        problems.raise_if_any(error)
        raise AssertionError("unreachable") from None  # pragma: no cover
    except yaml.YAMLError as exc:  # pragma: no cover - every PyYAML error is handled above
        problems.error(Location(path, 1, 1), f"YAML syntax error: {exc}")
        problems.raise_if_any(error)
        raise AssertionError("unreachable") from None
    except RecursionError:
        problems.error(
            Location(path, 1, 1), "the document is nested too deeply", "flatten the structure"
        )
        problems.raise_if_any(error)
        raise AssertionError("unreachable") from None  # pragma: no cover
    if root is None:
        problems.error(Location(path, 1, 1), "the file is empty", "write the document in it")
        problems.raise_if_any(error)
    converter = _Converter(path, problems)
    node = converter.convert(root, 0)
    problems.raise_if_any(error)
    return node


def _mark_location(path: str, mark: Any) -> Location:
    return Location(path, int(mark.line) + 1, int(mark.column) + 1)


def _position_location(path: str, text: str, position: int) -> Location:
    before = text[: max(0, position)]
    line = before.count("\n") + 1
    column = len(before) - (before.rfind("\n") + 1) + 1
    return Location(path, line, column)


def _syntax_hint(message: str, at_tab: bool) -> str:
    if at_tab or "tab" in message:
        return "indent with spaces, not tabs"
    if "mapping values are not allowed" in message:
        return "quote a value that contains ': ', or check the indentation"
    if "expected a single document" in message:
        return "keep one document per file (no second '---')"
    return "check the indentation and quoting around this place"


class _Converter:
    def __init__(self, path: str, problems: Problems) -> None:
        self.path = path
        self.problems = problems
        self.done: dict[int, Node] = {}
        self.active: set[int] = set()
        # One constructor per document: it caches what it built.
        self.constructor = yaml.constructor.SafeConstructor()

    def convert(self, node: Any, depth: int) -> Node:
        loc = _mark_location(self.path, node.start_mark)
        key = id(node)
        if key in self.done:  # an alias: share the converted node
            return self.done[key]
        if key in self.active:
            self.problems.error(loc, "recursive alias", "an anchor cannot contain itself")
            return Node("scalar", None, loc)
        if depth > MAX_DEPTH:
            self.problems.error(
                loc, f"the document is nested more than {MAX_DEPTH} levels deep", ""
            )
            return Node("scalar", None, loc)
        self.active.add(key)
        try:
            result = self._convert(node, loc, depth)
        finally:
            self.active.discard(key)
        self.done[key] = result
        return result

    def _convert(self, node: Any, loc: Location, depth: int) -> Node:
        if isinstance(node, yaml.MappingNode):
            values: dict[str, Node] = {}
            keys: dict[str, Location] = {}
            for key_node, value_node in node.value:
                key_loc = _mark_location(self.path, key_node.start_mark)
                if key_node.tag == "tag:yaml.org,2002:merge":
                    self.problems.error(
                        key_loc, "merge keys ('<<') are not supported", "write the keys out"
                    )
                    continue
                key = (
                    self._scalar(key_node, key_loc)
                    if isinstance(key_node, yaml.ScalarNode)
                    else None
                )
                if not isinstance(key, str):
                    shown = (
                        describe(key)
                        if isinstance(key_node, yaml.ScalarNode)
                        else ("a mapping" if isinstance(key_node, yaml.MappingNode) else "a list")
                    )
                    self.problems.error(
                        key_loc, f"keys must be strings, got {shown}", "quote the key"
                    )
                    continue
                if key in values:
                    first = keys[key]
                    self.problems.error(
                        key_loc,
                        f"duplicate key '{key}'",
                        f"first defined at line {first.line}, column {first.column}",
                    )
                    continue
                keys[key] = key_loc
                values[key] = self.convert(value_node, depth + 1)
            return Node("mapping", values, loc, keys)
        if isinstance(node, yaml.SequenceNode):
            return Node("sequence", [self.convert(v, depth + 1) for v in node.value], loc)
        return Node("scalar", self._scalar(node, loc), loc)

    def _scalar(self, node: Any, loc: Location) -> Any:
        try:
            return self.constructor.construct_object(node, deep=True)
        # PyYAML's constructors fail in many ways on a bad tagged scalar
        # (``!!timestamp x`` raises AttributeError): any failure is the text's.
        except Exception as exc:
            detail = getattr(exc, "problem", None) or str(exc)
            self.problems.error(
                loc,
                f"cannot read value with tag {node.tag!r}: {detail}",
                "remove the tag; only plain YAML values are accepted",
            )
            return None


# ----------------------------------------------------------- checking helpers


def describe(value: Any) -> str:
    """A person's name for the type of a plain value: 'a string', 'a list'..."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def _describe_node(node: Node) -> str:
    if node.kind == "mapping":
        return "a mapping"
    if node.kind == "sequence":
        return "a list"
    return describe(node.value)


def wrong_type(node: Node, problems: Problems, what: str, expected: str, hint: str = "") -> None:
    """Record "<what> must be <expected>, got <actual>" at the node."""
    problems.error(node.location, f"{what} must be {expected}, got {_describe_node(node)}", hint)


def nearest_hint(word: str, valid: Sequence[str]) -> str:
    """ "did you mean 'x'?" when a valid word is close, else the valid words."""
    close = difflib.get_close_matches(word, valid, n=1, cutoff=0.6)
    listing = ", ".join(valid)
    if close:
        return f"did you mean '{close[0]}'? valid: {listing}"
    return f"valid: {listing}"


def expect_mapping(node: Node, problems: Problems, *, what: str) -> dict[str, Node] | None:
    if node.kind != "mapping":
        wrong_type(node, problems, what, "a mapping")
        return None
    value: dict[str, Node] = node.value
    return value


def check_keys(
    node: Node,
    problems: Problems,
    *,
    what: str,
    required: Sequence[str] = (),
    optional: Sequence[str] = (),
) -> dict[str, Node] | None:
    """Check a mapping's keys: unknown ones (with the nearest valid key as a
    hint, at the key) and missing required ones (at the mapping).

    Returns the mapping's entries with the unknown keys left out, or ``None``
    if the node is not a mapping (a wrong-type problem is recorded).
    """
    fields = expect_mapping(node, problems, what=what)
    if fields is None:
        return None
    valid = [*required, *optional]
    known: dict[str, Node] = {}
    for key, value in fields.items():
        if key in valid:
            known[key] = value
        else:
            problems.error(
                node.keys[key], f"unknown key '{key}' in {what}", nearest_hint(key, valid)
            )
    for key in required:
        if key not in fields:
            problems.error(node.location, f"missing key '{key}' in {what}")
    return known


def expect_str(
    node: Node, problems: Problems, *, what: str, allow_empty: bool = False
) -> str | None:
    if node.kind != "scalar" or not isinstance(node.value, str):
        wrong_type(node, problems, what, "a string", "quote it if it looks like a number")
        return None
    if not allow_empty and not node.value:
        problems.error(node.location, f"{what} must not be empty")
        return None
    value: str = node.value
    return value


def expect_int(
    node: Node,
    problems: Problems,
    *,
    what: str,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    if node.kind != "scalar" or isinstance(node.value, bool) or not isinstance(node.value, int):
        wrong_type(node, problems, what, "an integer")
        return None
    value: int = node.value
    if minimum is not None and value < minimum:
        problems.error(node.location, f"{what} must be at least {minimum}, got {value}")
        return None
    if maximum is not None and value > maximum:
        problems.error(node.location, f"{what} must be at most {maximum}, got {value}")
        return None
    return value


def expect_bool(node: Node, problems: Problems, *, what: str) -> bool | None:
    if node.kind != "scalar" or not isinstance(node.value, bool):
        wrong_type(node, problems, what, "true or false")
        return None
    value: bool = node.value
    return value


def expect_scalar(node: Node, problems: Problems, *, what: str) -> str | int | float | bool | None:
    """A string, number or boolean (not null, not a list or mapping)."""
    if node.kind != "scalar" or not isinstance(node.value, str | int | float | bool):
        wrong_type(node, problems, what, "a string, number or boolean")
        return None
    value: str | int | float | bool = node.value
    return value


def expect_list(node: Node, problems: Problems, *, what: str) -> list[Node] | None:
    if node.kind != "sequence":
        wrong_type(node, problems, what, "a list")
        return None
    value: list[Node] = node.value
    return value


def expect_str_list(
    node: Node, problems: Problems, *, what: str, allow_single: bool = True
) -> list[tuple[str, Node]] | None:
    """A list of non-empty strings, or (``allow_single``) one string.

    Returns ``(string, node)`` pairs so callers can point at each item.
    """
    if allow_single and node.kind == "scalar" and isinstance(node.value, str):
        single = expect_str(node, problems, what=what)
        return None if single is None else [(single, node)]
    if node.kind != "sequence":
        expected = "a string or a list of strings" if allow_single else "a list of strings"
        wrong_type(node, problems, what, expected)
        return None
    items: list[tuple[str, Node]] = []
    if not node.value:
        problems.error(node.location, f"{what} must not be an empty list")
        return None
    ok = True
    for item in node.value:
        value = expect_str(item, problems, what=f"each item of {what}")
        if value is None:
            ok = False
        else:
            items.append((value, item))
    return items if ok else None
