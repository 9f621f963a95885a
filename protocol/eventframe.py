"""A tap's event as bytes, fast: ``encode_frame([Replicated(...)])`` without
building the ``Replicated`` and with the ``Enqueue`` commands it nearly
always carries packed by hand.

Every sidecar of the primary taps every command (the egress and each
standby: the standbys spool what they would send if they took over), so
this encoding is paid several times per message; the generic path (a plan
step per field, protocol/commandcodec.py) costs about 22 µs for an event of
one ``Enqueue`` on this project's machines, this one about a third of it
(bench/protocol_bench.py).  The bytes are the same, field for field: a test
encodes every kind of event both ways (tests/protocol/test_eventframe.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from protocol.cluster import (
    FRAME_HEADER,
    INDEX_ENTRY,
    MAX_COMMANDS_PER_FRAME,
    META_LEN,
    VERSION,
    Command,
    Enqueue,
    Kind,
    Replicated,
    encode_command,
)
from protocol.errors import LocalProtocolError
from protocol.modes import Mode
from protocol.values import pack_value_map

__all__ = ["encode_event"]

_ENQUEUE = int(Kind.ENQUEUE)
_REPLICATED = int(Kind.REPLICATED)
_ONE = FRAME_HEADER.pack(VERSION, 0, 1)
_EMPTY_MAP = pack_value_map({})
_POS_AND_ID = struct.Struct(">QH")  # Enqueue: pos | message_id length
_HEAD = struct.Struct(">QQIQH")  # Replicated: incarnation | cseq | epoch | time_us | modes
_FLAG = (b"\x00", b"\x01")
_KEY_MAX = 0xFFFF


def encode_event(
    origin: str,
    incarnation: int,
    cseq: int,
    epoch: int,
    time_us: int,
    modes: Sequence[Mode],
    commands: Sequence[Command],
) -> bytes:
    """The bus frame of one ``Replicated(origin, incarnation, cseq, epoch,
    time_us, modes, commands)``, as :func:`protocol.cluster.encode_frame`
    encodes it.  Raises :class:`LocalProtocolError` where it would."""
    if len(modes) != len(commands):
        raise LocalProtocolError(f"Replicated has {len(modes)} modes for {len(commands)} commands")
    if len(commands) > MAX_COMMANDS_PER_FRAME:
        raise LocalProtocolError(
            f"a frame holds at most {MAX_COMMANDS_PER_FRAME} commands, got {len(commands)}"
        )
    index: list[bytes] = []
    data: list[bytes | memoryview] = []
    for cmd in commands:
        if type(cmd) is Enqueue:
            key = cmd.queue.encode("utf-8")
            mid = cmd.message_id.encode("utf-8")
            if len(key) > _KEY_MAX or len(mid) > _KEY_MAX:
                raise LocalProtocolError(f"a name or id of {max(len(key), len(mid))} bytes")
            props = cmd.properties
            meta = b"".join(
                (
                    _POS_AND_ID.pack(cmd.pos, len(mid)),
                    mid,
                    pack_value_map(props) if props else _EMPTY_MAP,
                    _FLAG[bool(cmd.redelivered)],
                )
            )
            body = cmd.body
            index.append(INDEX_ENTRY.pack(_ENQUEUE, 0, len(key), 4 + len(meta) + len(body)))
            data += (key, META_LEN.pack(len(meta)), meta, body)
        elif isinstance(cmd, Replicated):
            raise LocalProtocolError("Replicated commands cannot be nested")
        else:
            kind, key, rest = encode_command(cmd)
            index.append(INDEX_ENTRY.pack(kind, 0, len(key), len(rest)))
            data += (key, rest)
    origin_key = origin.encode("utf-8")
    if len(origin_key) > _KEY_MAX:
        raise LocalProtocolError(f"name of {len(origin_key)} bytes is longer than 65535 bytes")
    try:
        head = _HEAD.pack(incarnation, cseq, epoch, time_us, len(modes)) + bytes(modes)
    except (struct.error, ValueError) as exc:
        raise LocalProtocolError(f"cannot encode Replicated: {exc}") from exc
    inner = b"".join([FRAME_HEADER.pack(VERSION, 0, len(commands)), *index, *data])
    rest_len = 4 + len(head) + len(inner)
    entry = INDEX_ENTRY.pack(_REPLICATED, 0, len(origin_key), rest_len)
    return b"".join((_ONE, entry, origin_key, META_LEN.pack(len(head)), head, inner))
