"""Mutation fuzzing of the spool's segment reader (gateway/spoolfile.py).

A segment is read back after a crash, a full disk or worse, so any bytes may
be found: the CRC of every record is re-computed after the damage, so it
reaches the record checks.  Only ``SpoolError`` (``SpoolCorruptError``) may
come out of the scan and of the reads of what it indexed, and every read ends.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from gateway.spoolfile import (
    HEADER_SIZE,
    PREAMBLE_SIZE,
    Chain,
    Event,
    SpoolCorruptError,
    SpoolError,
    encode_record,
    first_above,
    preamble,
    read_preamble,
    read_segment,
    record_crc,
    scan_segment,
    segment_name,
)
from tests.support.mutate import Mutator, fuzz

_HEAD = struct.Struct(">IIQQQ")


def _segment(first: int, count: int, gap: int = 0) -> bytes:
    records = [
        encode_record(
            seq, seq * 3, b"p" * (1 + seq % 7), prev_seq=seq - 1 - (gap if seq == first + 2 else 0)
        )
        for seq in range(first, first + count)
    ]
    return preamble(42) + b"".join(records)


FIRST = 100
SEEDS = [_segment(FIRST, 6), _segment(FIRST, 3, gap=1), preamble(42)]


def recrc(data: bytes) -> bytes:
    """``data`` with the CRC of every record a scan walks to re-computed."""
    buf = bytearray(data)
    pos = PREAMBLE_SIZE
    while pos + HEADER_SIZE <= len(buf):
        length, _crc, seq, prev, time_us = _HEAD.unpack_from(buf, pos)
        end = pos + HEADER_SIZE + length
        if end > len(buf):
            break
        struct.pack_into(
            ">I", buf, pos + 4, record_crc(seq, prev, time_us, bytes(buf[pos + HEADER_SIZE : end]))
        )
        pos = end
    return bytes(buf)


def damaged(m: Mutator, data: bytes) -> bytes:
    fields = [(PREAMBLE_SIZE, 4), (PREAMBLE_SIZE + 8, 8), (PREAMBLE_SIZE + 16, 8)]
    mutated = m.mutate(data, fields=fields)
    return mutated if m.rng.random() < 0.15 else recrc(mutated)


def scan_and_read(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    read_preamble(path)
    seg, _torn = scan_segment(path, Chain(0))
    if seg is None:
        return
    for after in (0, seg.first_seq, seg.last_seq - 1):
        out: list[Event] = []
        read_segment(seg, after, 1 << 20, out)
        assert [e[0] for e in out] == sorted({e[0] for e in out})
        if after < seg.last_seq:
            first_above(seg, after)


def test_spool_scan_and_reads_raise_only_spool_errors(tmp_path: Path) -> None:
    path = tmp_path / segment_name(FIRST)
    result = fuzz(
        "spool-segment",
        SEEDS,
        lambda data: scan_and_read(path, data),
        allowed=SpoolError,
        default_iterations=1500,
        make_input=damaged,
    )
    assert result.outcomes["ok"] > 0


def read_changed(path: Path, data: bytes) -> None:
    """Index the valid segment, then find ``data`` on disk when reading it."""
    path.write_bytes(SEEDS[0])
    seg, _ = scan_segment(path, Chain(0))
    assert seg is not None
    path.write_bytes(data)
    for after in (0, FIRST + 2):
        read_segment(seg, after, 1 << 20, [])
        first_above(seg, after)


def test_reads_of_a_segment_changed_since_its_scan_end_in_spool_errors(tmp_path: Path) -> None:
    path = tmp_path / segment_name(FIRST)
    fuzz(
        "spool-changed",
        SEEDS[:1],
        lambda data: read_changed(path, data),
        allowed=SpoolError,
        default_iterations=800,
        make_input=damaged,
    )


def _indexed_then_cut(tmp_path: Path, keep_of_last: int) -> object:
    """A six-record segment, indexed, then cut ``keep_of_last`` bytes into its last record."""
    path = tmp_path / segment_name(FIRST)
    path.write_bytes(SEEDS[0])
    seg, _ = scan_segment(path, Chain(0))
    assert seg is not None and seg.last_seq == FIRST + 5
    last = HEADER_SIZE + 1 + (FIRST + 5) % 7
    with open(path, "r+b") as f:
        f.truncate(seg.size - last + keep_of_last)
    return seg


def test_reading_a_segment_cut_since_its_scan_is_corruption(tmp_path: Path) -> None:
    """``read_segment`` re-read the cut record forever (it took the short read
    for a record larger than its chunk)."""
    seg = _indexed_then_cut(tmp_path, HEADER_SIZE)
    with pytest.raises(SpoolCorruptError, match="shorter than indexed"):
        read_segment(seg, FIRST + 4, 1 << 20, [])  # type: ignore[arg-type]


def test_first_above_in_a_segment_cut_since_its_scan_is_corruption(tmp_path: Path) -> None:
    """``first_above`` read the same few bytes of a cut header forever."""
    seg = _indexed_then_cut(tmp_path, 10)
    with pytest.raises(SpoolCorruptError, match="shorter than indexed"):
        first_above(seg, FIRST + 4)  # type: ignore[arg-type]
