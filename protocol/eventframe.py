"""A tap's event as bytes and back, fast: ``encode_frame([Replicated(...)])``
without building the ``Replicated`` and with the ``Enqueue`` commands it
nearly always carries packed by hand, and the decoding of a ``Replicated``
(registered in ``protocol.cluster.FAST_DECODERS``) with its inner frame read
in place and its ``Enqueue`` commands unpacked by hand.

Every sidecar of the primary taps every command (the egress and each
standby: the standbys spool what they would send if they took over), so
this encoding is paid several times per message, and every member of the
DR site decodes every event.  For an event of one ``Enqueue`` the generic
path (a plan step per field, protocol/commandcodec.py) takes about 14 µs to
encode and 21 µs to decode on this project's machines, this one about 5 and
11 (bench/event_bench.py; docs/performance.md).  The bytes are the same,
field for field, and so are the commands decoded and the refusals (only
:class:`RemoteProtocolError`): a test runs every kind of event both ways
(tests/protocol/test_eventframe.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from protocol import cluster
from protocol.cluster import (
    _DECODE_ERRORS,
    _MODE_OF,
    FRAME_HEADER,
    INDEX_ENTRY,
    MAX_COMMANDS_PER_FRAME,
    META_LEN,
    VERSION,
    Command,
    Enqueue,
    Kind,
    Replicated,
    _decode_at,
    _locate_meta_untrusted,
    encode_command,
    scan_frame_untrusted,
)
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.modes import Mode
from protocol.values import pack_value_map, unpack_value_map_untrusted

__all__ = ["decode_replicated_at", "encode_event"]

_ENQUEUE = int(Kind.ENQUEUE)
_REPLICATED = int(Kind.REPLICATED)
_ONE = FRAME_HEADER.pack(VERSION, 0, 1)
_EMPTY_MAP = pack_value_map({})
_POS_AND_ID = struct.Struct(">QH")  # Enqueue: pos | message_id length
_HEAD = struct.Struct(">QQIQH")  # Replicated: incarnation | cseq | epoch | time_us | modes
_FLAG = (b"\x00", b"\x01")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
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


def decode_replicated_at(key: str, data: bytes, view: memoryview, start: int, end: int) -> Command:
    """The ``Replicated`` whose rest is ``data[start:end]``, as the generic
    decoder builds it: its inner frame is read where it lies, the inner
    ``Enqueue`` commands by hand, any other by the generic decoder.  Fails
    only with :class:`RemoteProtocolError`."""
    _codec, meta_at, meta_end = _locate_meta_untrusted(_REPLICATED, key, data, start, end)
    try:
        if meta_end - meta_at < _HEAD.size:
            raise RemoteProtocolError("the fields run past its meta")
        incarnation, cseq, epoch, time_us, n = _HEAD.unpack_from(data, meta_at)
        modes_at = meta_at + _HEAD.size
        if modes_at + n != meta_end:
            raise RemoteProtocolError(f"{n} modes do not end its meta")
        modes = tuple([_MODE_OF[m] for m in data[modes_at:meta_end]])
        commands = _inner(data, view, meta_end, end)
    except RemoteProtocolError as exc:
        raise RemoteProtocolError(f"malformed REPLICATED command: {exc}") from exc
    except _DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed REPLICATED command: {exc}") from exc
    if len(commands) != len(modes):
        raise RemoteProtocolError(
            f"Replicated command has {len(modes)} modes for {len(commands)} commands"
        )
    return Replicated(key, incarnation, cseq, epoch, time_us, modes, commands)


def _inner(data: bytes, view: memoryview, at: int, end: int) -> tuple[Command, ...]:
    """The commands of the bus frame at ``data[at:end]``, located where they
    lie (:func:`protocol.cluster.scan_frame_untrusted`, its checks)."""
    commands: list[Command] = []
    for kind, key, size, offset in scan_frame_untrusted(data, at, end):
        if kind == _ENQUEUE:
            commands.append(_enqueue(key, data, view, offset, offset + size))
        elif kind == _REPLICATED:
            raise RemoteProtocolError("nested Replicated command")
        else:
            commands.append(_decode_at(kind, key, data, view, offset, offset + size))
    return tuple(commands)


def _enqueue(key: str, data: bytes, view: memoryview, start: int, end: int) -> Enqueue:
    """The ``Enqueue`` whose rest is ``data[start:end]``."""
    meta_at = start + 4
    if meta_at > end:
        raise RemoteProtocolError("truncated ENQUEUE command: no meta length")
    (meta_len,) = _U32.unpack_from(data, start)
    meta_end = meta_at + meta_len
    if meta_end > end:
        raise RemoteProtocolError(f"truncated ENQUEUE command: meta of {meta_len} bytes")
    pos, id_len = _POS_AND_ID.unpack_from(data, meta_at)
    id_at = meta_at + _POS_AND_ID.size
    message_id = data[id_at : id_at + id_len].decode("utf-8")
    props, flag_at = unpack_value_map_untrusted(data, id_at + id_len)
    if flag_at + 1 != meta_end:
        raise RemoteProtocolError("ENQUEUE command's fields do not end its meta")
    redelivered = data[flag_at] != 0
    return Enqueue(key, pos, view[meta_end:end], message_id, props, redelivered)


cluster.FAST_DECODERS[_REPLICATED] = decode_replicated_at
