"""The bus command of a planned switchover (docs/operations.md, "A planned
switchover"): P quiesces its replicated queues, hands its role over to its
DR site at a point of its stream, or aborts.  Declared like every other
command (protocol/commandcodec.py) and re-exported by :mod:`protocol.cluster`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from construct import Int8ub, Int64ub

from protocol.commandcodec import _MAP, Kind, _command, _CommandBase
from protocol.values import ValueMap


class SwitchoverPhase(enum.IntEnum):
    """What a ``Switchover`` does (docs/state.md, "Switchover")."""

    ABORT = 0  # at P: the switchover ends without a handover; the queues are writable again
    QUIESCE = 1  # at P: publishes to the guarded queues are refused, nothing more acquired
    # forwarded to D: D is promoted over P at this point of P's stream; with
    # ``guarded`` (configs that link both ways) P expects D's SWAP and keeps
    # those queues frozen (no acquisition, no settlement) until it comes
    HANDOVER = 2
    # The new primary's first event, forwarded to the site that handed over to
    # it: that site becomes its DR site at this point of the new primary's
    # stream, without a resync (``guarded``: each queue of the inner
    # command's mode, to the new primary's highest position in it).
    SWAP = 3
    # A failback by delta, after a forced promotion (docs/operations.md):
    # at the site ``to_cluster`` was promoted over, it becomes that site's DR
    # site, brought to its state by a resync that ships only what it lacks
    # (``guarded``: the queues it closes meanwhile) ...
    REJOIN = 4
    # ... and at the promoted site, it takes the primary's role for the site
    # it was promoted over, which the resync will make its DR site
    # (``guarded``: {"swapped": the value that makes this site the primary}).
    ADOPT = 5


# key=the DR site handed over to  meta: phase u8 | time_us u64 | guarded map
@_command(
    Kind.SWITCHOVER,
    key="to_cluster",
    meta=[("phase", Int8ub, SwitchoverPhase), ("time_us", Int64ub), ("guarded", _MAP)],
)
@dataclass(frozen=True, slots=True)
class Switchover(_CommandBase):
    """At a primary, a step of a planned switchover to ``to_cluster``
    (:class:`SwitchoverPhase`).  ``guarded`` (the keys; the values are
    unused) names the queues a ``QUIESCE`` closes to publishes and new
    acquisitions.  Every tap forwards ``QUIESCE`` and ``HANDOVER`` in the
    stream, so D applies the handover exactly after everything before it."""

    to_cluster: str
    phase: SwitchoverPhase
    time_us: int
    guarded: ValueMap = field(default_factory=dict)
