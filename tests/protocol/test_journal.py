"""The journal's file format (protocol/journal.py): golden vectors, the
construct declarations agree with the encoders, and the decoders' checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protocol import cluster as pc
from protocol import journal as pj
from protocol.errors import RemoteProtocolError

VECTORS = Path(__file__).parent.parent / "vectors" / "journal"
REGENERATE = os.environ.get("DRGATE_REGENERATE_VECTORS") == "1"

FRAME = pc.encode_frame([pc.Publish("", "orders", b"body", "m-1"), pc.Purge("orders")])
SAMPLES = {
    "segment_header": pj.encode_segment_header(42),
    "record_frame": pj.encode_record(42, 2, FRAME),
    "record_members_left": pj.encode_record(44, 0, pj.encode_members_left([(1, 7), (2, 9)])),
    "checkpoint_header": pj.encode_checkpoint_header(43, b"DRGS snapshot bytes"),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_golden_vectors(name: str) -> None:
    path = VECTORS / f"{name}.hex"
    if REGENERATE:
        path.write_text(SAMPLES[name].hex() + "\n")
    assert SAMPLES[name] == bytes.fromhex(path.read_text().strip()), (
        f"the encoding of {name} changed: a file format change needs a version"
    )


def test_the_construct_declarations_parse_what_the_encoders_write() -> None:
    head = pj.SegmentHeader.parse(SAMPLES["segment_header"])
    assert (head.version, head.first_cseq) == (pj.VERSION, 42)
    rec = pj.RecordHeader.parse(SAMPLES["record_frame"][: pj.RECORD_HEADER_SIZE])
    assert (rec.length, rec.first_cseq, rec.count) == (len(FRAME), 42, 2)
    assert rec.crc == pj.record_crc(42, 2, FRAME)
    ckpt = pj.CheckpointHeader.parse(SAMPLES["checkpoint_header"])
    assert (ckpt.cseq, ckpt.length) == (43, len(b"DRGS snapshot bytes"))
    members = pj.MembersLeft.parse(pj.encode_members_left([(1, 7), (2, 9)]))
    assert [(m.node, m.pid) for m in members] == [(1, 7), (2, 9)]


def test_records_read_back_and_name_their_damage() -> None:
    data = SAMPLES["segment_header"] + SAMPLES["record_frame"] + SAMPLES["record_members_left"]
    first = pj.next_record_untrusted(data, pj.SEGMENT_HEADER_SIZE)
    assert (first.first_cseq, first.count, bytes(first.payload)) == (42, 2, FRAME)
    second = pj.next_record_untrusted(data, first.end)
    assert pj.decode_members_left_untrusted(second.payload) == [(1, 7), (2, 9)]
    assert second.end == len(data)
    with pytest.raises(pj.RecordDamage, match="cut short") as cut:
        pj.next_record_untrusted(data[:-1], first.end)
    assert (cut.value.offset, cut.value.cut) == (first.end, True)
    flipped = bytearray(data)
    flipped[first.offset + pj.RECORD_HEADER_SIZE] ^= 1
    with pytest.raises(pj.RecordDamage, match="CRC mismatch in the record of cseq 42") as bad:
        pj.next_record_untrusted(bytes(flipped), first.offset)
    assert bad.value.cut is False  # more records follow it
    with pytest.raises(pj.RecordDamage, match="CRC mismatch") as last:
        pj.next_record_untrusted(bytes(flipped[: first.end]), first.offset)
    assert last.value.cut is True  # it ends the data: a torn tail


def test_a_checkpoint_reads_back_and_refuses_damage() -> None:
    snapshot = b"DRGS snapshot bytes"
    data = pj.encode_checkpoint_header(43, snapshot) + snapshot
    cseq, view = pj.decode_checkpoint_untrusted(data)
    assert (cseq, bytes(view)) == (43, snapshot)
    with pytest.raises(RemoteProtocolError, match="says 19 snapshot bytes, 18 present"):
        pj.decode_checkpoint_untrusted(data[:-1])
    with pytest.raises(RemoteProtocolError, match="CRC mismatch in the checkpoint of cseq 43"):
        pj.decode_checkpoint_untrusted(data[:-1] + b"!")
    with pytest.raises(RemoteProtocolError, match="not a drgate journal checkpoint"):
        pj.decode_checkpoint_untrusted(b"XXXX" + data[4:])
    with pytest.raises(RemoteProtocolError, match="version 2 is not supported"):
        pj.decode_segment_header_untrusted(b"DRGJ\x00\x02" + SAMPLES["segment_header"][6:])
