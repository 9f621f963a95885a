"""analysis.scan: the bulk scan gives what protocol/capture's exact scan gives.

For every segment, whole, cut or damaged: the same SegmentScan, or the same
RemoteProtocolError.  And the bulk path itself accepts every well-formed
segment that has its header (it does not quietly fall back to the exact scan,
which would keep the results equal and lose the speed).
"""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis import scan as bulk
from protocol.capture import (
    PREAMBLE_SIZE,
    RECORD_HEAD_SIZE,
    TAG_RECORD,
    TAG_STRING,
    CaptureRecord,
    CaptureRole,
    CaptureWriter,
    SegmentHeader,
    SegmentScan,
    Stream,
    scan_segment_untrusted,
)
from protocol.errors import RemoteProtocolError
from protocol.modes import Mode
from tests.protocol.test_capture import (
    Segment,
    _blocks,
    _framed,
    damaged_segments,
    segments,
    write_segment,
)


def outcome(scan: object, data: bytes) -> object:
    try:
        return scan(data)  # type: ignore[operator]
    except RemoteProtocolError as exc:
        return f"RemoteProtocolError: {exc}"


def assert_same(data: bytes) -> None:
    assert outcome(bulk.scan_segment, data) == outcome(scan_segment_untrusted, data)


def accepted(data: bytes) -> SegmentScan:
    """The bulk path's own result (no fallback), its record heads checked too."""
    scan, heads = bulk._scan_bulk(data)
    offsets = np.frombuffer(scan.record_offsets, np.uint64).astype(np.int64)
    whole = np.frombuffer(data, np.uint8)[offsets[:, None] + np.arange(RECORD_HEAD_SIZE)]
    assert np.array_equal(heads, whole)
    return scan


def header_is_whole(data: bytes) -> bool:
    if len(data) < PREAMBLE_SIZE + 9:
        return False
    length = int.from_bytes(data[PREAMBLE_SIZE : PREAMBLE_SIZE + 4], "big")
    return len(data) >= PREAMBLE_SIZE + 9 + length


def long_segment(records: int, *, payload_every: int = 0, close: bool = True) -> bytes:
    """Runs of equal records, new queue names now and then, payloads of varying length."""
    header = SegmentHeader("primary", 2, CaptureRole.EGRESS, Stream.FORWARDED, 5, 9, payloads=True)
    out = io.BytesIO()
    writer = CaptureWriter(out, header)
    for i in range(records):
        payload = bytes(i % 7) if payload_every and i % payload_every == 0 else None
        queues = (f"q{i // 300}",) if i % 200 else (f"q{i // 300}", "audit")
        writer.append(CaptureRecord(i, i + 1, 4, Mode(i % 4), queues, 100 + i % 9, payload=payload))
        if i % 1000 == 999:
            writer.flush()
    if close:
        writer.close(records)
    else:
        writer.flush()
    return out.getvalue()


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=30)
@given(segments(), st.data())
def test_bulk_scan_agrees_on_whole_and_cut_segments(seg: Segment, data: st.DataObject) -> None:
    whole = write_segment(*seg)
    cut = data.draw(st.integers(0, len(whole)))
    for piece in (whole, whole[:cut]):
        assert_same(piece)
        if header_is_whole(piece):  # well formed: the bulk path takes it itself
            assert accepted(piece) == scan_segment_untrusted(piece)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=30)
@given(segments(), st.data())
def test_bulk_scan_agrees_on_damaged_segments(seg: Segment, data: st.DataObject) -> None:
    damaged = bytearray(write_segment(*seg))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(damaged) - 1))
        damaged[at] = data.draw(st.integers(0, 255))
    assert_same(bytes(damaged))


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=60)
@given(damaged_segments())
def test_bulk_scan_agrees_on_blocks_damaged_behind_good_crcs(data: bytes) -> None:
    """A record's string ids, mode, flags or lengths wrong, its CRC right: the
    checks behind the CRC, which the bulk path makes as numpy columns."""
    assert_same(data)


@pytest.mark.parametrize("payload_every", [0, 1, 3])
def test_long_runs_agree_whole_cut_and_damaged(payload_every: int) -> None:
    data = long_segment(2000, payload_every=payload_every)
    assert accepted(data) == scan_segment_untrusted(data)
    assert scan_segment_untrusted(data).records == 2000
    rng = random.Random(payload_every)
    for cut in rng.sample(range(len(data)), 10):
        assert accepted(data[:cut]) == scan_segment_untrusted(data[:cut])
    for at in rng.sample(range(PREAMBLE_SIZE, len(data)), 15):
        damaged = bytearray(data)
        damaged[at] ^= 1 << rng.randrange(8)
        assert_same(bytes(damaged))
    open_segment = long_segment(1200, payload_every=payload_every, close=False)
    assert accepted(open_segment) == scan_segment_untrusted(open_segment)


@pytest.mark.parametrize(
    "tail",
    [
        b"\x00",  # a byte after the trailer
        b"\x00\x00\x00\x00S",  # a block frame after the trailer, cut
    ],
)
def test_bytes_after_the_trailer_are_the_exact_scans_error(tail: bytes) -> None:
    data = long_segment(50) + tail
    with pytest.raises(RemoteProtocolError, match="bytes after the trailer"):
        bulk.scan_segment(data)


@pytest.mark.parametrize("field", ["rule_name", "queue"])
def test_the_first_undefined_string_id_is_the_exact_scans_error(field: str) -> None:
    """A record naming the string about to be defined (its id one too high), CRC right."""
    blocks = _blocks(long_segment(900))
    defined = 0
    for i, (tag, body) in enumerate(blocks[1:], start=1):
        defined += tag == TAG_STRING
        if tag == TAG_RECORD and i > 100:
            at = 40 if field == "rule_name" else RECORD_HEAD_SIZE
            blocks[i] = (tag, body[:at] + defined.to_bytes(4, "big") + body[at + 4 :])
            break
    data = _framed(blocks)
    with pytest.raises(RemoteProtocolError, match="undefined string id"):
        bulk.scan_segment(data)
    with pytest.raises(bulk._Irregular):
        bulk._scan_bulk(data)
