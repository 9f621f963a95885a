"""Mutation fuzzing of the WAN link's decoders: frames (protocol/link/frames.py)
and the bytes the receiver and sender machines read from their peer.

The CRC32C of every frame is re-computed after the damage (and a compressed
block is damaged before it is compressed again), so the damage reaches the
payload parsers.  Only ``RemoteProtocolError`` may come out; an uncompressed
frame that decodes must encode back to the same bytes (one encoding per frame).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import zstandard
from crc32c import crc32c

from protocol.errors import RemoteProtocolError
from protocol.link import (
    NEED_DATA,
    EventsReceived,
    Hello,
    LinkEvent,
    LinkReceiver,
    LinkSender,
    ReceiverConfig,
    ResyncChunk,
    SenderConfig,
    Welcome,
)
from protocol.link.frames import (
    HEADER_SIZE,
    LinkErrorCode,
    decode_frame_untrusted,
    encode_frame,
)
from protocol.link.splitter import FrameSplitter
from tests.support.mutate import Mutator, fuzz

VECTORS = Path(__file__).resolve().parent.parent / "vectors" / "link"
SEEDS = [bytes.fromhex(p.read_text()) for p in sorted(VECTORS.glob("*.hex"))]
_HEAD = struct.Struct(">2sBBBI")  # magic, version, type, flags, length
_BATCH_HEAD = struct.Struct(">IQQIBI")


def recrc(data: bytes, *, fix_length: bool) -> bytes:
    """``data`` with every frame's CRC (and, if ``fix_length``, the last
    frame's length) re-computed, walking frames as a reader would."""
    buf = bytearray(data)
    pos = 0
    while pos + HEADER_SIZE <= len(buf):
        length = _HEAD.unpack_from(buf, pos)[4]
        rest = len(buf) - pos - HEADER_SIZE
        if length > rest and fix_length:
            length = rest
            struct.pack_into(">I", buf, pos + 5, length)
        end = pos + HEADER_SIZE + length
        if end > len(buf):
            break
        crc = crc32c(bytes(buf[pos + HEADER_SIZE : end]), crc32c(bytes(buf[pos : pos + 9])))
        struct.pack_into(">I", buf, pos + 9, crc)
        pos = end
    return bytes(buf)


def _recompressed(m: Mutator, frame: bytes) -> bytes | None:
    """A compressed BATCH or RESYNC_CHUNK damaged inside its block, compressed again."""
    ftype, flags = frame[3], frame[4]
    if not flags & 1:
        return None
    payload = frame[HEADER_SIZE:]
    head = 25 if ftype == 3 else 5  # the bytes before raw_length
    raw_length = int.from_bytes(payload[head : head + 4], "big")
    raw = zstandard.ZstdDecompressor().decompress(payload[head + 4 :], max_output_size=raw_length)
    raw = m.mutate(raw, fields=[(24, 4)] if ftype == 3 else ())
    block = zstandard.ZstdCompressor(level=1).compress(raw)
    if m.rng.random() < 0.8:
        raw_length = len(raw)
    payload = payload[:head] + raw_length.to_bytes(4, "big") + block
    return recrc(frame[:5] + len(payload).to_bytes(4, "big") + bytes(4) + payload, fix_length=False)


def damaged(m: Mutator, frame: bytes) -> bytes:
    if m.rng.random() < 0.2 and (again := _recompressed(m, frame)) is not None:
        return again
    # a BATCH's count and its first event's length are the fields worth aiming at
    fields = [(5, 4), (HEADER_SIZE + 20, 4), (HEADER_SIZE + 25, 4), (HEADER_SIZE + 53, 4)]
    mutated = m.mutate(frame, fields=fields)
    if m.rng.random() < 0.1:
        return mutated
    return recrc(mutated, fix_length=m.rng.random() < 0.7)


def decode_one(data: bytes) -> None:
    frame = decode_frame_untrusted(data)
    if not data[4] & 1:  # uncompressed: exactly one encoding
        assert encode_frame(frame) == data, frame


def test_frame_decoder_raises_only_remote_protocol_errors() -> None:
    result = fuzz(
        "link-frame",
        SEEDS,
        decode_one,
        allowed=RemoteProtocolError,
        default_iterations=4000,
        make_input=damaged,
    )
    assert result.outcomes["ok"] > 0
    # the damage reaches the parsers: most inputs pass the CRC
    assert result.share(f"RemoteProtocolError:{int(LinkErrorCode.BAD_CRC)}") < 0.2


def split_all(data: bytes) -> None:
    splitter = FrameSplitter()
    for start in range(0, len(data), 29):
        splitter.feed(data[start : start + 29])
        while splitter.next_frame_untrusted() is not None:
            pass


def test_splitter_raises_only_remote_protocol_errors() -> None:
    stream = b"".join(SEEDS)
    fuzz(
        "link-splitter",
        [stream],
        split_all,
        allowed=RemoteProtocolError,
        default_iterations=800,
        make_input=lambda m, data: recrc(m.mutate(data, rounds=4), fix_length=False),
    )


# --------------------------------------------------------------------------
# the machines' frame input
# --------------------------------------------------------------------------

SENDER = SenderConfig("P", "D", incarnation=5, epoch=2, linger=0.0, batch_max_events=3)


def _queue_stream(sender: LinkSender, after: int = 0) -> None:
    """Seven events above ``after`` (the WELCOME's resume point), then a resync."""
    if after > 2**63:
        return  # the egress would resync first; nothing here to fuzz
    for seq in range(after + 1, after + 8):
        sender.send_event(LinkEvent(seq, seq - after, b"x" * (seq - after), prev_seq=seq - 1))
    sender.begin_resync(after + 7, total_chunks=2, total_bytes=6)
    sender.send_chunk(b"abc")
    sender.send_chunk(b"def")
    sender.end_resync()


def _conversation() -> tuple[bytes, bytes]:
    """(what a sender writes, what a receiver writes) in one whole exchange."""
    sender = LinkSender(SENDER)
    receiver = LinkReceiver(ReceiverConfig("D", ack_every_events=1), now=0.0)
    to_receiver = sender.start(0.0)
    receiver.receive_data(to_receiver)
    assert isinstance(receiver.next_event(), Hello)
    to_sender = receiver.accept(0, 1 << 20, 0.0)
    sender.receive_data(to_sender)
    sender.next_event()
    _queue_stream(sender)
    now = 0.0
    for _ in range(6):
        now += 1.0
        out = sender.data_to_send(now)
        to_receiver += out
        receiver.receive_data(out)
        _drain_receiver(receiver)
        back = receiver.data_to_send(now)
        to_sender += back
        sender.receive_data(back)
        while sender.next_event() is not NEED_DATA:
            pass
    return to_receiver, to_sender


def _drain_receiver(receiver: LinkReceiver) -> None:
    while (event := receiver.next_event()) is not NEED_DATA:
        if isinstance(event, Hello):
            receiver.accept(0, 1 << 20, 0.0)
        elif isinstance(event, EventsReceived):
            receiver.ack(event.events[-1].seq)
        elif isinstance(event, ResyncChunk):
            receiver.ack_chunk()


TO_RECEIVER, TO_SENDER = _conversation()


def receive(data: bytes) -> None:
    receiver = LinkReceiver(ReceiverConfig("D", ack_every_events=1), now=0.0)
    for start in range(0, len(data), 61):
        receiver.receive_data(data[start : start + 61])
        _drain_receiver(receiver)
        receiver.data_to_send(1.0)
    receiver.receive_data(b"")
    _drain_receiver(receiver)


def send(data: bytes) -> None:
    sender = LinkSender(SENDER)
    sender.start(0.0)
    now = 0.0
    for start in range(0, len(data), 23):
        sender.receive_data(data[start : start + 23])
        while (event := sender.next_event()) is not NEED_DATA:
            if isinstance(event, Welcome):
                _queue_stream(sender, event.resume_from)
        now += 1.0
        sender.data_to_send(now)
    sender.receive_data(b"")
    while sender.next_event() is not NEED_DATA:
        pass


@pytest.mark.parametrize(
    ("name", "stream", "machine"),
    [("link-receiver", TO_RECEIVER, receive), ("link-sender", TO_SENDER, send)],
    ids=["receiver", "sender"],
)
def test_machines_raise_only_remote_protocol_errors(
    name: str, stream: bytes, machine: object
) -> None:
    machine(stream)  # type: ignore[operator]  # the undamaged exchange goes through
    result = fuzz(
        name,
        [stream],
        machine,  # type: ignore[arg-type]
        allowed=RemoteProtocolError,
        default_iterations=600,
        make_input=lambda m, data: recrc(m.mutate(data), fix_length=False),
    )
    assert result.share(f"RemoteProtocolError:{int(LinkErrorCode.BAD_CRC)}") < 0.3


@pytest.mark.parametrize(
    ("ftype", "payload"),
    [
        (10, b"\x00\x08\x00\x00\x24short"),  # ERROR: text length 36, 5 bytes left
        (7, bytes(24) + b"\x00\x09q"),  # RESYNC_BEGIN: scope length 9, 1 byte left
    ],
)
def test_a_string_longer_than_its_payload_is_malformed(ftype: int, payload: bytes) -> None:
    """The compiled parser took the short string (the frame decoded to
    something that encodes to other bytes)."""
    head = _HEAD.pack(b"DG", 1, ftype, 0, len(payload))
    data = head + crc32c(payload, crc32c(head)).to_bytes(4, "big") + payload
    with pytest.raises(RemoteProtocolError) as caught:
        decode_frame_untrusted(data)
    assert caught.value.code == LinkErrorCode.MALFORMED
