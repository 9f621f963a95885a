"""The bus commands of continuous verification (docs/operations.md,
"Verifying the copies"): a point of P's stream where the sites compare
(``VerifyPoint``), and what P's queue was there (``Verify``, inside a
``Replicated``).  Declared like every other command
(protocol/commandcodec.py) and re-exported by :mod:`protocol.cluster`."""

from __future__ import annotations

from dataclasses import dataclass

from construct import Int64ub

from protocol.commandcodec import _STR, Kind, _command, _CommandBase


# key=""  meta: time_us u64
@_command(Kind.VERIFY_POINT, meta=[("time_us", Int64ub)])
@dataclass(frozen=True, slots=True)
class VerifyPoint(_CommandBase):
    """At a primary: compare the replicas here.  Changes nothing in the
    state; every tap turns it into one ``Replicated`` of a ``Verify`` per
    replicated queue, made from the state at this command's cseq."""

    time_us: int


# key=queue  meta: depth u64 | newest_pos u64 | last_pos u64 | digest str16
@_command(
    Kind.VERIFY,
    key="queue",
    meta=[("depth", Int64ub), ("newest_pos", Int64ub), ("last_pos", Int64ub), ("digest", _STR)],
)
@dataclass(frozen=True, slots=True)
class Verify(_CommandBase):
    """Inside a ``Replicated``: what the origin's queue was at the origin
    cseq.  ``full``: its ``depth`` and content ``digest``, which the replica
    must match.  ``enqueue``: ``newest_pos``, the origin position of the
    newest message it still held (0: none), and ``last_pos``, of the last
    one published to it: the replica must have received the first and
    nothing beyond the second."""

    queue: str
    depth: int = 0
    newest_pos: int = 0
    last_pos: int = 0
    digest: str = ""
