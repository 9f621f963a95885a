"""protocol/capture: round trips, golden vectors, robustness, cut segments."""

from __future__ import annotations

import contextlib
import io
import random
import struct
from pathlib import Path

import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import capture
from protocol.capture import (
    NO_RULE,
    RECORD_HEAD_FIELDS,
    RECORD_HEAD_SIZE,
    CaptureReader,
    CaptureRecord,
    CaptureRole,
    CaptureWriter,
    SegmentDecoder,
    SegmentHeader,
    SegmentTrailer,
    Stream,
    scan_segment_untrusted,
)
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.modes import Mode
from tests.support.mutate import NO_SHRINK, Reach, mutated

VECTORS = Path(__file__).resolve().parent.parent / "vectors" / "capture"

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
names = st.text(min_size=0, max_size=20)

headers = st.builds(
    SegmentHeader,
    site=st.text(max_size=40).filter(lambda s: len(s.encode()) <= 255),
    node=u32,
    role=st.sampled_from(CaptureRole),
    stream=st.sampled_from(Stream),
    start_time_us=u64,
    incarnation=u64,
    payloads=st.booleans(),
)


def records(payloads: bool) -> st.SearchStrategy[CaptureRecord]:
    return st.builds(
        CaptureRecord,
        wall_time_us=u64,
        cseq=u64,
        kind=st.integers(0, 255),
        mode=st.sampled_from(Mode),
        queues=st.lists(names, max_size=5).map(tuple),
        size=u32,
        wire_size=u32,
        origin_cseq=u64,
        origin_incarnation=u64,
        rule_id=st.integers(0, 0xFFFF),
        rule_name=names,
        resync=st.booleans(),
        payload=st.none() | st.binary(max_size=64) if payloads else st.none(),
    )


Segment = tuple[SegmentHeader, list[CaptureRecord], int | None]


@st.composite
def segments(draw: st.DrawFn) -> Segment:
    header = draw(headers)
    recs = draw(st.lists(records(header.payloads), max_size=12))
    end = draw(st.none() | u64)
    return header, recs, end


def write_segment(
    header: SegmentHeader,
    recs: list[CaptureRecord],
    end_time_us: int | None,
    *,
    flush_every: int = 3,
) -> bytes:
    out = io.BytesIO()
    writer = CaptureWriter(out, header)
    for i, rec in enumerate(recs):
        writer.append(rec)
        if i % flush_every == flush_every - 1:
            writer.flush()
    if end_time_us is None:
        writer.flush()
    else:
        writer.close(end_time_us)
    return out.getvalue()


def read_segment(data: bytes, chunk_size: int = 7) -> tuple[CaptureReader, list[CaptureRecord]]:
    reader = CaptureReader(io.BytesIO(data), chunk_size=chunk_size)
    return reader, list(reader)


# --- round trips -------------------------------------------------------------


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(segments(), st.integers(1, 64))
def test_segment_round_trip(seg: Segment, chunk_size: int) -> None:
    header, recs, end = seg
    data = write_segment(header, recs, end)
    reader, got = read_segment(data, chunk_size)
    assert reader.header == header
    assert got == recs
    assert reader.complete is (end is not None)
    assert reader.cut is (end is None)
    if end is not None:
        assert reader.trailer == SegmentTrailer(len(recs), len(data) - 33, end)
    else:
        assert reader.trailer is None


@given(segments())
def test_scan_agrees_with_decoder(seg: Segment) -> None:
    header, recs, end = seg
    data = write_segment(header, recs, end)
    scan = scan_segment_untrusted(data)
    assert scan.header == header
    assert scan.complete is (end is not None)
    assert scan.records == len(recs)
    head = struct.Struct(">" + "".join(_struct_code(t) for _, t in RECORD_HEAD_FIELDS))
    assert head.size == RECORD_HEAD_SIZE
    for off, rec in zip(scan.record_offsets, recs, strict=True):
        values = head.unpack_from(data, off)
        fields = dict(zip([n for n, _ in RECORD_HEAD_FIELDS], values, strict=True))
        assert fields["wall_time_us"] == rec.wall_time_us
        assert fields["cseq"] == rec.cseq
        assert fields["origin_incarnation"] == rec.origin_incarnation
        assert fields["mode"] == rec.mode
        assert scan.strings[fields["rule_name"]] == rec.rule_name
        ids = struct.unpack_from(f">{fields['queue_count']}I", data, off + RECORD_HEAD_SIZE)
        assert tuple(scan.strings[i] for i in ids) == rec.queues


def _struct_code(numpy_type: str) -> str:
    return {"u1": "B", "u2": "H", "u4": "I", "u8": "Q"}[numpy_type.lstrip("><")]


@given(records(payloads=True))
def test_writer_record_matches_construct_definition(rec: CaptureRecord) -> None:
    ids = list(range(len(rec.queues)))
    body = capture.encode_record_body(rec, ids, 7)
    parsed = capture.RecordBody.parse(body)
    assert parsed.cseq == rec.cseq
    assert parsed.rule_name == 7
    assert list(parsed.queue_ids) == ids
    rebuilt = capture.RecordBody.build({k: v for k, v in parsed.items() if not k.startswith("_")})
    assert rebuilt == body


@given(headers)
def test_header_round_trip(header: SegmentHeader) -> None:
    block = capture.encode_header(header)
    assert capture.decode_header_body_untrusted(block[5:-4]) == header


@given(u64, u64, u64)
def test_trailer_round_trip(records_: int, bytes_: int, end: int) -> None:
    block = capture.encode_trailer(SegmentTrailer(records_, bytes_, end))
    parsed = capture.TrailerBody.parse(block[5:-4])
    assert (parsed.records, parsed.bytes, parsed.end_time_us) == (records_, bytes_, end)


# --- golden vectors ------------------------------------------------------------

GOLDEN_HEADER = SegmentHeader(
    site="primary",
    node=2,
    role=CaptureRole.EGRESS,
    stream=Stream.FORWARDED,
    start_time_us=1_700_000_000_000_000,
    incarnation=0x0123456789ABCDEF,
    payloads=True,
)
GOLDEN_RECORDS = [
    CaptureRecord(
        wall_time_us=1_700_000_000_000_100,
        cseq=10,
        kind=4,
        mode=Mode.FULL,
        queues=("orders",),
        size=210,
        wire_size=35,
        rule_id=0,
        rule_name="orders-full",
    ),
    CaptureRecord(
        wall_time_us=1_700_000_000_000_200,
        cseq=11,
        kind=4,
        mode=Mode.ENQUEUE,
        queues=("audit", "orders"),
        size=180,
        origin_cseq=3,
        origin_incarnation=99,
        rule_id=NO_RULE,
        rule_name="",
        resync=True,
        payload=b"\x00body\xff",
    ),
    CaptureRecord(
        wall_time_us=1_700_000_000_000_300,
        cseq=12,
        kind=1,
        mode=Mode.WIRING,
        size=64,
        rule_id=1,
        rule_name="wiring",
        payload=b"",
    ),
]
GOLDEN_END = 1_700_000_000_001_000


def test_golden_complete_segment_both_ways() -> None:
    data = (VECTORS / "segment_complete.bin").read_bytes()
    assert write_segment(GOLDEN_HEADER, GOLDEN_RECORDS, GOLDEN_END) == data
    reader, got = read_segment(data)
    assert reader.header == GOLDEN_HEADER
    assert got == GOLDEN_RECORDS
    assert reader.complete
    assert reader.trailer == SegmentTrailer(3, len(data) - 33, GOLDEN_END)


def test_golden_cut_segment_both_ways() -> None:
    data = (VECTORS / "segment_cut.bin").read_bytes()
    full = write_segment(GOLDEN_HEADER, GOLDEN_RECORDS, GOLDEN_END)
    assert full.startswith(data)
    reader, got = read_segment(data)
    assert got == GOLDEN_RECORDS[:2]
    assert reader.cut and not reader.complete and reader.trailer is None


def test_golden_blocks_both_ways() -> None:
    header_block = (VECTORS / "header.bin").read_bytes()
    assert capture.encode_preamble() + capture.encode_header(GOLDEN_HEADER) == header_block
    assert capture.decode_header_body_untrusted(header_block[8 + 5 : -4]) == GOLDEN_HEADER
    trailer = SegmentTrailer(3, 400, GOLDEN_END)
    trailer_block = (VECTORS / "trailer.bin").read_bytes()
    assert capture.encode_trailer(trailer) == trailer_block
    parsed = capture.TrailerBody.parse(trailer_block[5:-4])
    assert (parsed.records, parsed.bytes, parsed.end_time_us) == (3, 400, GOLDEN_END)


def test_golden_layout_is_documented() -> None:
    # Byte-level spot checks so a layout change fails here with a clear reason.
    data = (VECTORS / "header.bin").read_bytes()
    assert data[:8] == b"DRGCAP\x01\x00"
    length, tag = struct.unpack_from(">IB", data, 8)
    assert tag == ord("H")
    assert length == 24 + 1 + len("primary")
    assert RECORD_HEAD_SIZE == 54


# --- cut segments ----------------------------------------------------------------


def test_every_truncation_reads_whole_records_then_reports_cut() -> None:
    data = write_segment(GOLDEN_HEADER, GOLDEN_RECORDS, GOLDEN_END)
    # record ends: where each record block finishes, found from the scan
    scan = scan_segment_untrusted(data)
    ends = []
    for off in scan.record_offsets:
        (length,) = struct.unpack_from(">I", data, off - 5)
        ends.append(off + length + 4)
    for cut in range(len(data)):
        reader, got = read_segment(data[:cut], chunk_size=5)
        whole = sum(1 for e in ends if e <= cut)
        assert got == GOLDEN_RECORDS[:whole], cut
        assert reader.cut and not reader.complete
        bulk = scan_segment_untrusted(data[:cut])
        assert bulk.records == whole and not bulk.complete
        assert bulk.cut_at is not None and bulk.cut_at <= cut


def test_cut_before_header_has_no_header() -> None:
    reader, got = read_segment(b"DRGCA")
    assert reader.header is None and got == [] and reader.cut


def test_writer_killed_mid_flush_segment_is_readable() -> None:
    """A writer that dies after a partial write leaves a cut, readable segment."""
    header = SegmentHeader("p", 1, CaptureRole.EGRESS, Stream.TAPPED, 0)
    recs = [CaptureRecord(i, i, 4, Mode.FULL, (f"q{i % 3}",), size=i) for i in range(50)]
    out = io.BytesIO()
    writer = CaptureWriter(out, header)
    for rec in recs[:30]:
        writer.append(rec)
    writer.flush()
    for rec in recs[30:]:
        writer.append(rec)
    pending = writer.buffered
    writer.flush()
    data = out.getvalue()[: -(pending // 2)]  # the last write landed only in part
    reader, got = read_segment(data, chunk_size=4096)
    assert got == recs[: len(got)]
    assert 30 <= len(got) < 50
    assert reader.cut


# --- robustness ----------------------------------------------------------------------


def _decode_everything(data: bytes) -> None:
    reader = CaptureReader(io.BytesIO(data), chunk_size=13)
    for _ in reader:
        pass
    scan_segment_untrusted(data)


def _blocks(data: bytes) -> list[tuple[int, bytes]]:
    """The (tag, body) of every block of a valid segment, after its preamble."""
    out, pos = [], capture.PREAMBLE_SIZE
    while pos < len(data):
        length, tag = struct.unpack_from(">IB", data, pos)
        out.append((tag, data[pos + 5 : pos + 5 + length]))
        pos += 9 + length
    return out


def _framed(blocks: list[tuple[int, bytes]]) -> bytes:
    """A preamble and ``blocks``, each with its length and CRC made right."""
    out = [capture.encode_preamble()]
    for tag, body in blocks:
        head = struct.pack(">IB", len(body), tag)
        out.append(head + body + struct.pack(">I", crc32c(body, crc32c(head))))
    return b"".join(out)


# A record's string ids, mode, flags, queue count and payload length: the
# fields worth aiming at (docs/protocol.md, the record body).
RECORD_FIELDS = ((40, 4), (45, 1), (48, 1), (49, 1), (50, 4), (54, 4))


@st.composite
def damaged_segments(draw: st.DrawFn) -> bytes:
    """A valid segment of records with one block damaged (its body mutated,
    or the block dropped or repeated), then framed again with the magic,
    lengths and CRCs right, so the block parsers run; one in ten is damaged
    anywhere and left as it is, one in twenty is left whole."""
    header = draw(headers)
    recs = draw(st.lists(records(header.payloads), min_size=1, max_size=12))
    good = write_segment(header, recs, draw(st.none() | u64))
    how = draw(st.integers(0, 19))
    if how == 0:
        return good
    if how <= 2:
        return mutated(draw, good)
    blocks = _blocks(good)
    records_at = [k for k, (tag, _) in enumerate(blocks) if tag == capture.TAG_RECORD]
    if draw(st.integers(0, 3)):  # mostly a record: the parser the others lead to
        i = draw(st.sampled_from(records_at))
    else:
        i = draw(st.integers(0, len(blocks) - 1))
    tag, body = blocks[i]
    if how == 3:
        del blocks[i]
    elif how == 4:
        blocks.insert(i, blocks[i])
    else:
        blocks[i] = (tag, mutated(draw, body, fields=RECORD_FIELDS if tag == 0x52 else ()))
    return _framed(blocks)


def _reached_a_record(data: bytes) -> bool:
    """The decoder handed up a record, or refused one in its record parser
    (the block it stopped after, having passed its length and CRC, is a record)."""
    decoder = SegmentDecoder()
    decoder.receive_data(data)
    try:
        while not isinstance(event := decoder.next_event(), type(capture.NEED_DATA)):
            if isinstance(event, CaptureRecord):
                return True
    except RemoteProtocolError:
        pos, tag = capture.PREAMBLE_SIZE, None
        while pos < decoder.offset:  # the blocks it took: their lengths held
            length, tag = struct.unpack_from(">IB", data, pos)
            pos += 9 + length
        return tag == capture.TAG_RECORD
    return False


def test_damaged_segments_raise_only_protocol_errors() -> None:
    reach = Reach("capture segment")

    @NO_SHRINK
    @given(damaged_segments())
    def decode(data: bytes) -> None:
        reach.note(_reached_a_record(data))
        with contextlib.suppress(RemoteProtocolError):
            _decode_everything(data)

    decode()
    reach.check()


def test_every_single_bit_flip_is_detected_or_harmless() -> None:
    data = write_segment(GOLDEN_HEADER, GOLDEN_RECORDS, GOLDEN_END)
    rng = random.Random(7)
    positions = rng.sample(range(len(data) * 8), 400)
    for bit in positions:
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            reader, got = read_segment(bytes(flipped))
        except RemoteProtocolError:
            pass
        else:
            # A flip in a length field can only make the segment look cut,
            # never make a wrong record come out.
            assert got == GOLDEN_RECORDS[: len(got)]
            assert not reader.complete
        try:
            scan = scan_segment_untrusted(bytes(flipped))
        except RemoteProtocolError:
            pass
        else:
            assert not scan.complete


def test_decoders_refuse_specific_corruptions() -> None:
    data = write_segment(GOLDEN_HEADER, GOLDEN_RECORDS, GOLDEN_END)
    with pytest.raises(RemoteProtocolError, match="bad magic"):
        _decode_everything(b"XRGCAP\x01\x00" + data[8:])
    with pytest.raises(RemoteProtocolError, match="version"):
        _decode_everything(b"DRGCAP\x02\x00" + data[8:])
    with pytest.raises(RemoteProtocolError, match="after the trailer"):
        _decode_everything(data + b"\x00")
    bad_crc = bytearray(data)
    bad_crc[-1] ^= 0xFF
    with pytest.raises(RemoteProtocolError, match="CRC32C"):
        _decode_everything(bytes(bad_crc))


def test_decoder_sans_io_events_in_order() -> None:
    data = write_segment(GOLDEN_HEADER, GOLDEN_RECORDS, GOLDEN_END)
    decoder = SegmentDecoder()
    events = []
    for i in range(0, len(data), 3):
        decoder.receive_data(data[i : i + 3])
        while not isinstance(event := decoder.next_event(), type(capture.NEED_DATA)):
            events.append(event)
    assert decoder.end_of_data()
    assert events[0] == GOLDEN_HEADER
    assert events[1:-1] == GOLDEN_RECORDS
    assert isinstance(events[-1], SegmentTrailer)


# --- writer contract ---------------------------------------------------------------------


def test_writer_batches_writes() -> None:
    class CountingIO(io.BytesIO):
        writes = 0

        def write(self, b: bytes) -> int:  # type: ignore[override]
            self.writes += 1
            return super().write(b)

    out = CountingIO()
    writer = CaptureWriter(out, GOLDEN_HEADER)
    for rec in GOLDEN_RECORDS * 10:
        writer.append(rec)
    assert out.writes == 0 and writer.records == 30
    writer.flush()
    assert out.writes == 1 and writer.buffered == 0
    trailer = writer.close(5)
    assert out.writes == 2 and trailer.records == 30
    assert writer.statistics()["bytes"] == len(out.getvalue())


def test_writer_refuses_what_the_format_cannot_hold() -> None:
    no_payloads = SegmentHeader("p", 1, CaptureRole.EGRESS, Stream.TAPPED, 0, payloads=False)
    writer = CaptureWriter(io.BytesIO(), no_payloads)
    with pytest.raises(LocalProtocolError, match="payload"):
        writer.append(CaptureRecord(0, 1, 1, Mode.FULL, payload=b"x"))
    with pytest.raises(LocalProtocolError, match="queues"):
        writer.append(CaptureRecord(0, 1, 1, Mode.FULL, queues=tuple(map(str, range(256)))))
    with pytest.raises(LocalProtocolError, match="cseq"):
        writer.append(CaptureRecord(0, -1, 1, Mode.FULL))
    writer.close(0)
    with pytest.raises(LocalProtocolError, match="closed"):
        writer.append(CaptureRecord(0, 1, 1, Mode.FULL))
