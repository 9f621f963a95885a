"""Mutation fuzzing of the broker journal's files (protocol/journal.py,
cluster/journal.py).

A journal is read back after a crash, a full disk or worse, so any bytes may
be found.  Record and checkpoint CRCs are re-computed after the damage (most
of the time), so it reaches the record, frame and snapshot checks.  Only
``JournalError`` may come out of opening and recovering a journal, and only
``RemoteProtocolError`` out of the pure decoders.
"""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

from cluster import state as st
from cluster.journal import Journal, JournalError
from protocol import cluster as pc
from protocol import journal as pj
from protocol.errors import RemoteProtocolError
from tests.support.mutate import Mutator, fuzz
from tests.support.state import Member

_RECORD = struct.Struct(">IIQI")


def _frames() -> list[list[pc.Command]]:
    sid = 1 << 40
    return [
        [pc.Genesis("site-p", 7), pc.QueueDeclare("q", {"durable": True})],
        [pc.SessionOpen(sid), pc.Publish("", "q", b"body-1", "m1", {"k": 1})],
        [pc.Publish("", "q", b"b" * 40, "m2"), pc.Acquire("q", sid, 0, 1)],
        [pc.Accept("q", sid, (1,)), pc.Publish("", "q", b"c", "m3")],
    ]


def _segment(*, members_left: bool) -> bytes:
    records = []
    cseq = 1
    for k, frame in enumerate(_frames()):
        records.append(pj.encode_record(cseq, len(frame), pc.encode_frame(frame)))
        cseq += len(frame)
        if members_left and k == 2:
            records.append(pj.encode_record(cseq, 0, pj.encode_members_left([(1, 0), (2, 5)])))
    return pj.encode_segment_header(1) + b"".join(records)


def _checkpoint() -> bytes:
    state = st.new_state()
    for frame in _frames():
        st.apply_all(state, frame)
    st.members_left(state, [Member(1, 0)])
    snapshot = st.snapshot(state)
    return pj.encode_checkpoint_header(state.cseq, snapshot) + snapshot


SEGMENTS = [_segment(members_left=False), _segment(members_left=True), pj.encode_segment_header(1)]
CHECKPOINT = _checkpoint()
CHECKPOINT_CSEQ = pj.parse_checkpoint_header_untrusted(CHECKPOINT).cseq


def recrc_segment(data: bytes) -> bytes:
    """``data`` with the CRC of every record a scan walks to re-computed."""
    buf = bytearray(data)
    pos = pj.SEGMENT_HEADER_SIZE
    while pos + pj.RECORD_HEADER_SIZE <= len(buf):
        length, _crc, first, count = _RECORD.unpack_from(buf, pos)
        end = pos + pj.RECORD_HEADER_SIZE + length
        if end > len(buf):
            break
        payload = bytes(buf[pos + pj.RECORD_HEADER_SIZE : end])
        struct.pack_into(">I", buf, pos + 4, pj.record_crc(first, count, payload))
        pos = end
    return bytes(buf)


def recrc_checkpoint(data: bytes) -> bytes:
    """``data`` with its checkpoint CRC re-computed over what follows the header."""
    if len(data) < pj.CHECKPOINT_HEADER_SIZE:
        return data
    buf = bytearray(data)
    cseq = int.from_bytes(buf[8:16], "big")
    snapshot = bytes(buf[pj.CHECKPOINT_HEADER_SIZE :])
    buf[16:24] = len(snapshot).to_bytes(8, "big")
    buf[24:28] = pj.checkpoint_crc(cseq, snapshot).to_bytes(4, "big")
    return bytes(buf)


def damaged_segment(m: Mutator, data: bytes) -> bytes:
    h = pj.SEGMENT_HEADER_SIZE
    fields = [(8, 8), (h, 4), (h + 8, 8), (h + 16, 4)]
    mutated = m.mutate(data, fields=fields)
    return mutated if m.rng.random() < 0.15 else recrc_segment(mutated)


def damaged_checkpoint(m: Mutator, data: bytes) -> bytes:
    mutated = m.mutate(data, fields=[(8, 8), (16, 8)])
    return mutated if m.rng.random() < 0.15 else recrc_checkpoint(mutated)


def _fresh(directory: Path) -> None:
    for path in directory.iterdir():
        if path.name != "journal.lock":
            path.unlink()


def open_and_recover(directory: Path, files: dict[str, bytes]) -> None:
    _fresh(directory)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    with Journal.open(directory, fsync="never") as journal:
        result = journal.recover()
        if result is not None:
            assert result.state.cseq == result.cseq
            # What was recovered can be appended to and read back.
            journal.append(result.cseq + 1, [pc.Purge("q")])
            journal.commit()
    with Journal.open(directory, fsync="never") as journal:
        again = journal.recover()
        assert again is not None or result is None


def test_opening_damaged_segments_raises_only_journal_errors(tmp_path: Path) -> None:
    name = pj.segment_name(1)
    result = fuzz(
        "journal-segment",
        SEGMENTS,
        lambda data: open_and_recover(tmp_path, {name: data}),
        allowed=JournalError,
        default_iterations=1500,
        make_input=damaged_segment,
    )
    assert result.outcomes["ok"] > 0
    assert result.outcomes["JournalError"] > 0


def test_opening_damaged_checkpoints_raises_only_journal_errors(tmp_path: Path) -> None:
    files = {pj.segment_name(CHECKPOINT_CSEQ + 1): pj.encode_segment_header(CHECKPOINT_CSEQ + 1)}
    name = pj.checkpoint_name(CHECKPOINT_CSEQ)
    result = fuzz(
        "journal-checkpoint",
        [CHECKPOINT],
        lambda data: open_and_recover(tmp_path, {name: data, **files}),
        allowed=JournalError,
        default_iterations=800,
        make_input=damaged_checkpoint,
    )
    assert result.outcomes["ok"] > 0
    assert result.outcomes["JournalError"] > 0


def decode_everything(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        pj.decode_segment_header_untrusted(data)
    offset = pj.SEGMENT_HEADER_SIZE
    while offset < len(data):
        rec = pj.next_record_untrusted(data, offset)
        if rec.count == 0:
            pj.decode_members_left_untrusted(rec.payload)
        else:
            pc.decode_frame_untrusted(rec.payload)
        offset = rec.end


def test_the_record_decoders_raise_only_remote_protocol_errors() -> None:
    fuzz(
        "journal-records",
        SEGMENTS,
        decode_everything,
        allowed=RemoteProtocolError,
        default_iterations=3000,
        make_input=damaged_segment,
    )


def test_the_checkpoint_decoder_raises_only_remote_protocol_errors() -> None:
    fuzz(
        "journal-checkpoint-header",
        [CHECKPOINT],
        lambda data: st.restore_untrusted(pj.decode_checkpoint_untrusted(data)[1]),
        allowed=RemoteProtocolError,
        default_iterations=3000,
        make_input=damaged_checkpoint,
    )
