"""What a site that rejoins as the DR site holds (a failback by delta,
docs/operations.md): carried in its WELCOME to the primary (link minor 3),
so the primary's resync leaves out the messages it has (``Keep``,
protocol/resynccommands.py).

Per queue, by the receiving site's name for it, two lists of position
ranges: the positions of its own messages (published there), and the
origin positions of the messages it holds replicated from the primary.
Positions only grow and a message never changes, so a range is all it
takes to name them; the ``Keep``'s digest catches a queue deleted and
declared again in between.

Layout (big-endian)::

    holdings := u32 n | n x queue
    queue    := name str16 | u32 a | a x range | u32 b | b x range
    range    := first u64 | last u64            (first <= last)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from construct import ConstructError, Int16ub, Int32ub, Int64ub, PascalString, PrefixedArray, Struct

from protocol.errors import RemoteProtocolError
from protocol.exactparse import parse_exact

__all__ = [
    "HOLDINGS_MAX_BYTES",
    "Held",
    "Holdings",
    "pack_holdings",
    "ranges_of",
    "unpack_holdings_untrusted",
]

# What one WELCOME may carry (16 bytes a range): queues beyond it are left
# out, and the primary ships their messages whole.
HOLDINGS_MAX_BYTES = 4 * 1024 * 1024

_RANGE = Struct("first" / Int64ub, "last" / Int64ub)
_QUEUE = Struct(
    "name" / PascalString(Int16ub, "utf8"),
    "own" / PrefixedArray(Int32ub, _RANGE),
    "replicated" / PrefixedArray(Int32ub, _RANGE),
)
_HOLDINGS = PrefixedArray(Int32ub, _QUEUE).compile()


@dataclass(slots=True)
class Held:
    """One queue's holdings: sorted, disjoint ``(first, last)`` ranges."""

    own: list[tuple[int, int]] = field(default_factory=list)
    replicated: list[tuple[int, int]] = field(default_factory=list)

    def holds(self, pos: int, *, replicated: bool) -> bool:
        """Does the site hold its message ``pos`` (``replicated``: the
        primary's message of origin position ``pos``)?"""
        ranges = self.replicated if replicated else self.own
        i = bisect.bisect_right(ranges, (pos, 2**64)) - 1
        return i >= 0 and ranges[i][0] <= pos <= ranges[i][1]


Holdings = dict[str, Held]


def ranges_of(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted positions as ``(first, last)`` runs of consecutive ones."""
    ranges: list[tuple[int, int]] = []
    for pos in sorted(positions):
        if ranges and pos == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], pos)
        elif not ranges or pos > ranges[-1][1]:
            ranges.append((pos, pos))
    return ranges


def pack_holdings(holdings: Holdings) -> bytes:
    """The wire form; queues past :data:`HOLDINGS_MAX_BYTES` are left out."""
    queues = []
    size = 4
    for name, held in holdings.items():
        size += 10 + len(name.encode("utf-8")) + 16 * (len(held.own) + len(held.replicated))
        if size > HOLDINGS_MAX_BYTES:
            break
        queues.append(
            {
                "name": name,
                "own": [{"first": a, "last": b} for a, b in held.own],
                "replicated": [{"first": a, "last": b} for a, b in held.replicated],
            }
        )
    return _HOLDINGS.build(queues)


def unpack_holdings_untrusted(data: bytes) -> Holdings:
    """Parse a peer's holdings; :class:`RemoteProtocolError` if malformed."""
    try:
        parsed = parse_exact(_HOLDINGS, data)
    except (ConstructError, UnicodeDecodeError) as exc:
        raise RemoteProtocolError(f"malformed holdings in a WELCOME: {exc}") from exc
    holdings: Holdings = {}
    for q in parsed:
        held = Held(_checked(q.own, q.name), _checked(q.replicated, q.name))
        holdings[q.name] = held
    return holdings


def _checked(ranges: Iterable[object], queue: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for r in ranges:
        first, last = r.first, r.last  # type: ignore[attr-defined]
        if first > last or (out and first <= out[-1][1]):
            raise RemoteProtocolError(
                f"holdings of queue {queue!r} in a WELCOME are not sorted disjoint ranges"
            )
        out.append((first, last))
    return out
