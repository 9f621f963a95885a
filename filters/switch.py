"""Switching rules at run time, identically on every tap.

Theory of operation (docs/architecture.md, section 7).  The sidecar that sees its
rules file change calls :func:`decide_switch` with the rules in force and the
new text:

* :class:`SwitchUnchanged` -- same bytes as the rules in force (a touch, a
  rewrite with the same content): nothing to do.
* :class:`SwitchRefused` -- the new text is invalid.  The old rules stay in
  force.  The caller logs ``problems`` once per distinct ``digest`` (so a
  file left broken is not logged on every poll) and counts it in a metric.
* :class:`SwitchAccepted` -- valid.  The caller multicasts
  ``payload.to_bytes()`` as the body of the rules-switch bus command
  (``protocol.cluster`` carries these bytes opaque).

Every tap, the proposer included, applies the switch when the bus delivers
it, at that command's ``cseq``, with :func:`apply_switch`.  The new
:class:`~filters.matcher.RuleSet` depends only on the current rules and the
payload, so taps that applied the same bus stream hold the same rules, and a
takeover of the egress never changes what is forwarded.  If two sidecars
propose different texts, the bus orders the two commands and the later one
wins everywhere.

Payload layout (big-endian)::

    magic "DRRS" (4) | format u8 = 1 | rules_version u64 | sha256 (32)
    | text length u32 | text (UTF-8)
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from protocol.errors import Location, Problem, RemoteProtocolError, RulesError

from .matcher import RuleSet
from .rules import load_rules

__all__ = [
    "RulesPayload",
    "SwitchAccepted",
    "SwitchDecision",
    "SwitchRefused",
    "SwitchUnchanged",
    "apply_switch",
    "decide_switch",
    "payload_of",
]

MAGIC = b"DRRS"
FORMAT = 1
_HEADER = struct.Struct(">4sBQ32sI")
# A rules file is a few KB; anything near this is a mistake, and the bus
# splits large payloads only up to a point.
MAX_TEXT_BYTES = 4 * 1024 * 1024


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass(frozen=True, slots=True)
class RulesPayload:
    """The body of a rules-switch bus command: version, sha256 and the text."""

    rules_version: int
    digest: bytes
    text: str

    @classmethod
    def for_text(cls, text: str, rules_version: int) -> RulesPayload:
        return cls(rules_version, _digest(text.encode("utf-8", "surrogatepass")), text)

    def to_bytes(self) -> bytes:
        data = self.text.encode("utf-8")
        if len(data) > MAX_TEXT_BYTES:
            raise ValueError(f"rules text of {len(data)} bytes exceeds {MAX_TEXT_BYTES}")
        return _HEADER.pack(MAGIC, FORMAT, self.rules_version, self.digest, len(data)) + data

    @classmethod
    def from_bytes_untrusted(cls, data: bytes) -> RulesPayload:
        """Decode a payload from the bus.  Fails only with ``RemoteProtocolError``."""
        if len(data) < _HEADER.size:
            raise RemoteProtocolError(f"rules switch payload too short: {len(data)} bytes")
        magic, fmt, version, digest, length = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise RemoteProtocolError(f"rules switch payload: bad magic {magic!r}")
        if fmt != FORMAT:
            raise RemoteProtocolError(f"rules switch payload: unknown format {fmt}")
        body = bytes(data[_HEADER.size :])
        if length != len(body) or length > MAX_TEXT_BYTES:
            raise RemoteProtocolError(
                f"rules switch payload: length {length} but {len(body)} bytes follow"
            )
        if _digest(body) != digest:
            raise RemoteProtocolError("rules switch payload: sha256 does not match the text")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RemoteProtocolError(f"rules switch payload: text is not UTF-8: {exc}") from None
        return cls(version, digest, text)

    from_bytes = from_bytes_untrusted


@dataclass(frozen=True, slots=True)
class SwitchAccepted:
    payload: RulesPayload
    warnings: tuple[Problem, ...] = ()


@dataclass(frozen=True, slots=True)
class SwitchRefused:
    """The new file is invalid; ``digest`` (hex) identifies the bad content."""

    problems: tuple[Problem, ...]
    digest: str


@dataclass(frozen=True, slots=True)
class SwitchUnchanged:
    digest: str


SwitchDecision = SwitchAccepted | SwitchRefused | SwitchUnchanged


def decide_switch(current: RuleSet, new_text: str, path: str) -> SwitchDecision:
    """Decide what to do about a changed rules file (see the module docstring)."""
    digest = hashlib.sha256(new_text.encode("utf-8", "surrogatepass")).hexdigest()
    if digest == current.digest:
        return SwitchUnchanged(digest)
    try:
        candidate = load_rules(new_text, path)
    except RulesError as exc:
        return SwitchRefused(tuple(exc.problems), digest)
    try:
        payload = RulesPayload.for_text(new_text, current.rules_version + 1)
        payload.to_bytes()  # the text must travel: UTF-8 and not too large
    except (UnicodeError, ValueError) as exc:
        problem = Problem(Location(path, 1, 1), f"cannot send these rules: {exc}")
        return SwitchRefused((problem,), digest)
    return SwitchAccepted(payload, tuple(candidate.warnings))


def apply_switch(
    current: RuleSet, payload: RulesPayload, cseq: int, *, path: str = "<rules switch>"
) -> RuleSet:
    """The rules in force after the switch delivered at ``cseq``.

    Deterministic: the result depends only on ``current`` and ``payload``.
    The same text as the rules in force returns ``current`` unchanged.
    Otherwise ``rules_version`` is ``current.rules_version + 1`` (the
    proposer's number is advisory: two proposals may carry the same one).
    Raises ``RulesError`` only if this drgate cannot read rules that the
    proposer validated (mixed versions during an upgrade); the caller keeps
    ``current`` and reports it.
    """
    if payload.digest.hex() == current.digest:
        return current
    return load_rules(payload.text, path, rules_version=current.rules_version + 1, cseq=cseq)


def payload_of(ruleset: RuleSet) -> RulesPayload:
    """The payload that recreates ``ruleset`` (for state transfer to a joiner)."""
    return RulesPayload.for_text(ruleset.text, ruleset.rules_version)
