"""Mutation fuzzing of the capture segment decoders (protocol/capture.py).

Every block's CRC32C is re-computed after the damage, so it reaches the block
parsers; the three readers (``SegmentDecoder``, ``CaptureReader``,
``scan_segment_untrusted``) must fail only with ``RemoteProtocolError`` and
agree on what they read.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest
from crc32c import crc32c

from protocol.capture import (
    PREAMBLE_SIZE,
    CaptureReader,
    CaptureRecord,
    CaptureRole,
    CaptureWriter,
    SegmentDecoder,
    SegmentHeader,
    Stream,
    scan_segment_untrusted,
)
from protocol.errors import RemoteProtocolError
from protocol.modes import Mode
from tests.support.mutate import Mutator, fuzz

VECTORS = Path(__file__).resolve().parent.parent / "vectors" / "capture"
_FRAME = struct.Struct(">IB")


def _built(payloads: bool) -> bytes:
    out = io.BytesIO()
    header = SegmentHeader("dr", 7, CaptureRole.INGRESS, Stream.INGESTED, 5, 9, payloads)
    writer = CaptureWriter(out, header)
    for i in range(4):
        writer.append(
            CaptureRecord(
                wall_time_us=i,
                cseq=i + 1,
                kind=i,
                mode=Mode(i % 4),
                queues=tuple(f"q{j}" for j in range(i)),
                rule_id=i,
                rule_name="r" if i else "",
                payload=b"p" * i if payloads else None,
            )
        )
    if not payloads:
        writer.close(99)
    writer.flush()
    return out.getvalue()


SEEDS = [
    (VECTORS / "segment_complete.bin").read_bytes(),
    (VECTORS / "segment_cut.bin").read_bytes(),
    (VECTORS / "header.bin").read_bytes(),
    _built(True),
    _built(False),
]


def recrc(data: bytes) -> bytes:
    """``data`` with the CRC of every block a reader walks to re-computed."""
    buf = bytearray(data)
    pos = PREAMBLE_SIZE
    while pos + _FRAME.size <= len(buf):
        (length, _tag) = _FRAME.unpack_from(buf, pos)
        end = pos + _FRAME.size + length
        if end + 4 > len(buf):
            break
        buf[end : end + 4] = crc32c(bytes(buf[pos:end])).to_bytes(4, "big")
        pos = end + 4
    return bytes(buf)


def block_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of each block's length and of the record heads' counts."""
    fields = []
    pos = PREAMBLE_SIZE
    while pos + _FRAME.size <= len(data):
        (length, tag) = _FRAME.unpack_from(data, pos)
        fields.append((pos, 4))
        if tag == 0x52:  # a record: its queue_count u8 and payload_len u32
            fields += [(pos + 5 + 49, 1), (pos + 5 + 50, 4)]
        pos += _FRAME.size + length + 4
    return fields


def damaged(m: Mutator, data: bytes) -> bytes:
    mutated = m.mutate(data, fields=block_fields(data))
    return mutated if m.rng.random() < 0.1 else recrc(mutated)


def read_all(data: bytes) -> None:
    """Read ``data`` with all three readers; they must agree."""
    outcome = []
    for read in (_decoder, _reader, _scan):
        try:
            outcome.append(read(data))
        except RemoteProtocolError as exc:
            outcome.append(("error", type(exc)))
    assert outcome[0] == outcome[1] == outcome[2], outcome
    if outcome[0][0] == "error":
        raise RemoteProtocolError("refused by all three readers")


def _decoder(data: bytes) -> tuple[str, int, bool]:
    decoder = SegmentDecoder()
    records = 0
    for start in range(0, len(data), 37):  # an odd chunk size: blocks straddle feeds
        decoder.receive_data(data[start : start + 37])
        while not isinstance(event := decoder.next_event(), type(capture_need_data())):
            records += isinstance(event, CaptureRecord)
    return "read", records, decoder.end_of_data()


def capture_need_data() -> object:
    from protocol.capture import NEED_DATA

    return NEED_DATA


def _reader(data: bytes) -> tuple[str, int, bool]:
    reader = CaptureReader(io.BytesIO(data), chunk_size=41)
    records = sum(1 for _ in reader)
    return "read", records, reader.complete


def _scan(data: bytes) -> tuple[str, int, bool]:
    scan = scan_segment_untrusted(data)
    return "read", scan.records, scan.complete


def test_capture_readers_raise_only_remote_protocol_errors() -> None:
    result = fuzz(
        "capture",
        SEEDS,
        read_all,
        allowed=RemoteProtocolError,
        default_iterations=3000,
        make_input=damaged,
    )
    assert result.outcomes["ok"] > 0


@pytest.mark.parametrize("body", [b"", b"\x00", bytes(5), bytes(53)])
def test_a_short_record_block_is_corruption(body: bytes) -> None:
    """A record block shorter than the record head, under a valid CRC, is a
    ``RemoteProtocolError`` from every reader (it was a bare ``struct.error``
    from the sans-IO decoder, which ``drgate analyze`` died of)."""
    header = (VECTORS / "header.bin").read_bytes()
    block = _FRAME.pack(len(body), 0x52) + body
    data = header + block + crc32c(block).to_bytes(4, "big")
    for read in (_decoder, _reader, _scan):
        with pytest.raises(RemoteProtocolError, match="record"):
            read(data)


def test_a_string_whose_length_claims_more_than_its_block_is_corruption() -> None:
    """The compiled parser read the short string and let it through."""
    header = (VECTORS / "header.bin").read_bytes()
    block = _FRAME.pack(5, 0x53) + b"\x00\x09abc"
    data = header + block + crc32c(block).to_bytes(4, "big")
    for read in (_decoder, _reader, _scan):
        with pytest.raises(RemoteProtocolError, match="bad string"):
            read(data)
