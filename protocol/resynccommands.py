"""The bus commands of a resync (docs/architecture.md, the link and its
resync snapshot): a snapshot of an origin's replicated queues staged in pieces
(``ResyncStage``) and installed at one point of the stream
(``ResyncCommit``), or applied whole (``ResyncApply``); inside a snapshot, a
``Keep`` stands for messages the receiving site holds already (a failback
by delta).  Declared like every
other command (protocol/commandcodec.py) and re-exported by
:mod:`protocol.cluster`."""

from __future__ import annotations

from dataclasses import dataclass

from construct import Flag, Int32ub, Int64ub

from protocol.commandcodec import Body, Kind, _command, _CommandBase


# key=origin cluster  meta: incarnation u64 | cut u64 | epoch u32 | index u32
#                     tail: snapshot records (protocol/snapshotrecords.py)
@_command(
    Kind.RESYNC_STAGE,
    key="origin_cluster",
    meta=[
        ("incarnation", Int64ub),
        ("cut", Int64ub),
        ("epoch", Int32ub),
        ("index", Int32ub),
    ],
    tail="records",
)
@dataclass(frozen=True, slots=True)
class ResyncStage(_CommandBase):
    """Piece ``index`` (from 0) of a resync snapshot of ``origin_cluster`` cut
    at its ``cut`` cseq: every member decodes it into a staging area no client
    sees, and the ``ResyncCommit`` that ends the resync installs it.  Piece 0
    starts a new staging (dropping any unfinished one of that origin).

    ``records`` is a sequence of ``u32 length | bus frame`` records (see
    protocol/snapshotrecords.py); each frame holds ``Replicated`` commands
    whose inner commands (exchange and queue declares, binds, enqueues)
    describe the origin's state at the cut."""

    origin_cluster: str
    incarnation: int
    cut: int
    epoch: int
    index: int
    records: Body = b""


# key=origin cluster  meta: incarnation u64 | cut u64 | epoch u32 | origin_time_us u64
#                     tail: the snapshot (protocol/snapshotrecords.py)
@_command(
    Kind.RESYNC_APPLY,
    key="origin_cluster",
    meta=[
        ("incarnation", Int64ub),
        ("cut", Int64ub),
        ("epoch", Int32ub),
        ("origin_time_us", Int64ub),
    ],
    tail="snapshot",
)
@dataclass(frozen=True, slots=True)
class ResyncApply(_CommandBase):
    """A whole resync snapshot of ``origin_cluster``'s replicated queues, cut
    at its ``cut`` cseq, applied by every member at this one point of the
    stream: a ``ResyncStage`` of index 0 and a ``ResyncCommit`` of one piece
    in a single command.  (The ingress sends stages and a commit; this form
    is kept for small snapshots, tests and captures made before them.)

    ``snapshot`` is a sequence of ``u32 length | bus frame`` records (see
    protocol/snapshotrecords.py); each frame holds ``Replicated`` commands
    whose inner commands (exchange and queue declares, binds, enqueues)
    describe the origin's state at the cut.  It stays opaque bytes until applied.
    """

    origin_cluster: str
    incarnation: int
    cut: int
    epoch: int
    origin_time_us: int
    snapshot: Body = b""


# key=origin cluster  meta: incarnation u64 | cut u64 | epoch u32 | origin_time_us u64
#                           | pieces u32
@_command(
    Kind.RESYNC_COMMIT,
    key="origin_cluster",
    meta=[
        ("incarnation", Int64ub),
        ("cut", Int64ub),
        ("epoch", Int32ub),
        ("origin_time_us", Int64ub),
        ("pieces", Int32ub),
    ],
)
@dataclass(frozen=True, slots=True)
class ResyncCommit(_CommandBase):
    """The end of a staged resync of ``origin_cluster`` cut at ``cut``: every
    member installs, at this one point of the stream, the ``pieces``
    ``ResyncStage`` pieces it staged, replacing what the site holds of the
    origin.  Staged pieces of another cut, epoch or count install nothing."""

    origin_cluster: str
    incarnation: int
    cut: int
    epoch: int
    origin_time_us: int
    pieces: int


# key=queue  meta: pos u64 | held_pos u64 | count u32 | replicated u8 | nbytes u64
#            tail: digest (8 bytes)
@_command(
    Kind.KEEP,
    key="queue",
    meta=[
        ("pos", Int64ub),
        ("held_pos", Int64ub),
        ("count", Int32ub),
        ("replicated", Flag),
        ("nbytes", Int64ub),
    ],
    tail="digest",
)
@dataclass(frozen=True, slots=True)
class Keep(_CommandBase):
    """Inside a resync snapshot sent to a site that announced what it holds
    (a failback by delta, docs/operations.md): ``count`` messages of
    ``queue`` at the sender's positions ``pos``.., which the receiving site
    holds already and so are not shipped.  It holds them at its positions
    ``held_pos``.. as its own messages, or, ``replicated``, as messages
    replicated from the sender at those origin positions.  ``digest``
    (gateway/resync.py ``kept_digest``) covers their ids, properties and
    bodies: the receiver checks it before it stages them; ``nbytes`` is what
    their ``Enqueue`` commands would have taken (the bytes not shipped)."""

    queue: str
    pos: int
    held_pos: int
    count: int
    replicated: bool
    nbytes: int
    digest: Body = b""
