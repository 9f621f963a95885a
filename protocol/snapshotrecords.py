"""Resync snapshots: the records that RESYNC_APPLY, RESYNC_STAGE and the
link's resync chunks carry, ``u32 length | bus frame of REPLICATED``
(docs/protocol.md).  A snapshot is the concatenation of records, so it can be
cut into chunks at record boundaries and joined again by concatenation."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

from protocol.cluster import Replicated, decode_frame_untrusted, encode_frame
from protocol.errors import RemoteProtocolError

#   length u32 (of the bus frame that follows)
SNAPSHOT_RECORD = struct.Struct(">I")


def encode_snapshot_record(commands: Sequence[Replicated]) -> bytes:
    """One snapshot record: ``u32 length | bus frame`` of ``commands``.

    A snapshot is the concatenation of records, so it can be cut into link
    chunks at record boundaries and joined again by plain concatenation."""
    frame = encode_frame(commands)
    return SNAPSHOT_RECORD.pack(len(frame)) + frame


def iter_snapshot_untrusted(snapshot: bytes | memoryview) -> Iterator[Replicated]:
    """The ``Replicated`` commands of a snapshot, in order.  Fails only with
    :class:`RemoteProtocolError` (a truncated record, a bad frame, a command
    that is not ``Replicated``)."""
    view = memoryview(snapshot)
    offset = 0
    while offset < len(view):
        if offset + SNAPSHOT_RECORD.size > len(view):
            raise RemoteProtocolError(f"snapshot truncated at byte {offset}: no record length")
        (length,) = SNAPSHOT_RECORD.unpack_from(view, offset)
        offset += SNAPSHOT_RECORD.size
        if offset + length > len(view):
            raise RemoteProtocolError(
                f"snapshot record at byte {offset} of {length} bytes goes past the end"
            )
        for cmd in decode_frame_untrusted(view[offset : offset + length]):
            if not isinstance(cmd, Replicated):
                raise RemoteProtocolError(
                    f"snapshot holds a {type(cmd).__name__} command; only Replicated may appear"
                )
            yield cmd
        offset += length
