"""Checking a whole capture segment in bulk, for the Spark data source.

:func:`scan_segment` returns exactly what
:func:`protocol.capture.scan_segment_untrusted` returns for the same bytes
(the same :class:`~protocol.capture.SegmentScan`, or the same
``RemoteProtocolError``), with the per-record work done by numpy and C
instead of a Python statement per check:

* **Runs of equal blocks.**  A capture is mostly records of one length (no
  payloads, one queue each).  From a block of length L the next blocks of a
  run start every L + 9 bytes, so one numpy gather reads all their length
  fields and finds where the run ends.  Where lengths vary (payloads), the
  scan walks a few blocks one at a time before trying a run again.
* **CRCs per run.**  ``struct.iter_unpack`` cuts a run into the bytes each
  CRC covers, and ``map(crc32c, ...)`` checks them without a Python frame
  per block; numpy compares them with the stored CRCs.
* **Record heads** are copied out as one strided view per run (the blocks
  of a run are evenly spaced) and checked as numpy columns (mode, flags,
  lengths, string ids) over every record at once; the data source builds
  its Arrow columns from the same rows.  The few string blocks, the header
  and the trailer are decoded one by one with protocol/capture's own
  decoders.

The bulk path only ever *accepts*: anything it does not find well formed
(a bad CRC, an unknown tag, a string id not yet defined, ...) makes it hand
the whole segment to ``scan_segment_untrusted``, which finds the same fault
and raises its error with its offset.  Corrupt segments are rare and their
error is what matters, so they may take the slow way.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable
from operator import itemgetter
from typing import Final, TypeVar

import numpy as np
from crc32c import crc32c

from protocol import capture as cap
from protocol.errors import RemoteProtocolError
from protocol.exactparse import parse_exact

T = TypeVar("T")

_U32 = struct.Struct(">I")
_FRAME: Final = 5  # length u32 | tag u8
_BLOCK_EXTRA: Final = _FRAME + 4  # frame + crc32c u32
# a run is tried over at most this many blocks at once (numpy's arrays stay small)
_RUN_WINDOW_MAX: Final = 1 << 16
# after a run shorter than this, the next blocks are walked one at a time
_SHORT_RUN: Final = 8
_WALK_STEPS: Final = 64
_BE_U32 = np.dtype(">u4")


class _Irregular(Exception):
    """Something the bulk path does not accept: the exact scan decides."""


def scan_segment(data: bytes) -> cap.SegmentScan:
    """:func:`protocol.capture.scan_segment_untrusted`, in bulk (see the module docstring)."""
    return scan_segment_heads(data)[0]


def scan_segment_heads(data: bytes) -> tuple[cap.SegmentScan, np.ndarray]:
    """:func:`scan_segment` and every record's fixed head, one row of
    ``RECORD_HEAD_SIZE`` bytes per record (C-contiguous, for a structured view)."""
    try:
        return _scan_bulk(data)
    except _Irregular:
        scan = cap.scan_segment_untrusted(data)
        buf = np.frombuffer(data, np.uint8)
        offsets = np.frombuffer(scan.record_offsets, np.uint64).astype(np.int64)
        return scan, buf[offsets[:, None] + np.arange(cap.RECORD_HEAD_SIZE)]


def u32_at(buf: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Big-endian u32 at each position of ``buf`` (int64 positions)."""
    values: np.ndarray = buf[positions[:, None] + np.arange(4)].view(_BE_U32)[:, 0]
    return values


def _scan_bulk(data: bytes) -> tuple[cap.SegmentScan, np.ndarray]:
    size = len(data)
    if size < cap.PREAMBLE_SIZE + _BLOCK_EXTRA:
        raise _Irregular  # at most a preamble: nothing to gain
    try:
        cap.decode_preamble_untrusted(data)
    except RemoteProtocolError:
        raise _Irregular from None
    buf = np.frombuffer(data, np.uint8)
    runs, pos = _walk(data, buf, cap.PREAMBLE_SIZE)
    starts, lengths = _blocks(runs)
    if len(starts) == 0:
        raise _Irregular
    tags = buf[starts + 4]
    ends = starts + _FRAME + lengths
    # the header is the first block, alone
    if tags[0] != cap.TAG_HEADER:
        raise _Irregular
    header = _decode(cap.decode_header_body_untrusted, data, int(starts[0]), int(ends[0]))
    scan = cap.SegmentScan(header=header, trailer=None, complete=False, cut_at=None)
    tags, starts, lengths, ends = tags[1:], starts[1:], lengths[1:], ends[1:]
    is_record = tags == cap.TAG_RECORD
    is_string = tags == cap.TAG_STRING
    is_trailer = tags == cap.TAG_TRAILER
    if not np.all(is_record | is_string | is_trailer):
        raise _Irregular
    trailers = np.flatnonzero(is_trailer)
    if len(trailers) > 1 or (len(trailers) == 1 and (trailers[0] != len(tags) - 1 or pos != size)):
        raise _Irregular  # a trailer that is not the very last thing in the segment
    for i in np.flatnonzero(is_string).tolist():
        scan.strings.append(
            _decode(
                lambda body: parse_exact(cap.StringBody, body).text,
                data,
                int(starts[i]),
                int(ends[i]),
            )
        )
    record_starts = starts[is_record] + _FRAME
    heads = _heads(buf, runs, len(record_starts))[1:][is_record]
    _check_records(
        buf, heads, record_starts, lengths[is_record], header.payloads, is_string, is_record
    )
    scan.record_offsets = array("Q", record_starts.astype(np.uint64).tobytes())
    if len(trailers):
        at = int(starts[-1])
        parsed = _decode(lambda body: parse_exact(cap.TrailerBody, body), data, at, int(ends[-1]))
        if parsed.records != len(record_starts) or parsed.bytes != at:
            raise _Irregular
        scan.trailer = cap.SegmentTrailer(parsed.records, parsed.bytes, parsed.end_time_us)
        scan.complete = True
    else:
        scan.cut_at = pos
    return scan, heads


def _decode(decoder: Callable[[bytes], T], data: bytes, start: int, end: int) -> T:
    try:
        return decoder(data[start + _FRAME : end])
    except Exception:
        raise _Irregular from None


def _walk(data: bytes, buf: np.ndarray, pos: int) -> tuple[list[tuple[int, int, int]], int]:
    """Every whole block from ``pos``, CRCs checked: runs of (start, blocks, body length)
    of equal blocks, and where they end.

    Stops at the first block that is not whole (a cut segment); a block longer
    than ``MAX_BLOCK`` or a CRC that differs is irregular.
    """
    size = len(data)
    runs: list[tuple[int, int, int]] = []  # (start, blocks, body length)
    window = _SHORT_RUN
    walk = 0
    while size - pos >= _FRAME:
        (length,) = _U32.unpack_from(data, pos)
        if length > cap.MAX_BLOCK:
            raise _Irregular
        stride = length + _BLOCK_EXTRA
        fits = (size - pos) // stride
        if fits == 0:
            break  # cut in this block
        if walk or fits == 1:
            count = 1
            walk = max(walk - 1, 0)
        else:
            k = min(fits, window)
            lens = u32_at(buf, pos + stride * np.arange(k, dtype=np.int64))
            differs = np.flatnonzero(lens != length)
            count = int(differs[0]) if len(differs) else k
            if count == k:
                window = min(window * 2, _RUN_WINDOW_MAX)
            else:
                window = _SHORT_RUN
                if count < _SHORT_RUN:
                    walk = _WALK_STEPS
        _check_crcs(data, pos, count, length)
        runs.append((pos, count, length))
        pos += count * stride
    return runs, pos


def _blocks(runs: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The start and body length of every block of ``runs``."""
    if not runs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = np.array([r[0] for r in runs], np.int64)
    counts = np.array([r[1] for r in runs], np.int64)
    lengths = np.array([r[2] for r in runs], np.int64)
    index = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    starts = np.repeat(first, counts) + index * np.repeat(lengths + _BLOCK_EXTRA, counts)
    return starts, np.repeat(lengths, counts)


def _heads(buf: np.ndarray, runs: list[tuple[int, int, int]], records: int) -> np.ndarray:
    """The first ``RECORD_HEAD_SIZE`` body bytes of every block (zeros where the
    body is shorter: such a block is no valid record), one row per block.

    A run's blocks are evenly spaced, so its rows are one strided view of the
    bytes and the copy is a memcpy per row, not an index per byte."""
    size = cap.RECORD_HEAD_SIZE
    if len(runs) > records // 4 + 2:  # short runs (payloads): one gather is cheaper
        starts, lengths = _blocks(runs)
        padded = np.concatenate([buf, np.zeros(size, np.uint8)])  # a short last block
        rows: np.ndarray = padded[(starts + _FRAME)[:, None] + np.arange(size)]
        rows[lengths < size] = 0
        return rows
    pieces = []
    for pos, count, length in runs:
        if length < size:
            pieces.append(np.zeros((count, size), np.uint8))
        else:
            pieces.append(
                np.lib.stride_tricks.as_strided(
                    buf[pos + _FRAME :], (count, size), (length + _BLOCK_EXTRA, 1), writeable=False
                )
            )
    return np.concatenate(pieces)


def _check_crcs(data: bytes, pos: int, count: int, length: int) -> None:
    """The CRCs of ``count`` consecutive blocks of body ``length`` from ``pos``."""
    stride = length + _BLOCK_EXTRA
    chunk = data[pos : pos + count * stride]
    covered = struct.iter_unpack(f"{length + _FRAME}s4x", chunk)
    computed = np.fromiter(map(crc32c, map(itemgetter(0), covered)), np.uint32, count)
    stored = np.frombuffer(chunk, np.uint8).reshape(count, stride)[:, stride - 4 :]
    if not np.array_equal(computed, stored.copy().view(_BE_U32)[:, 0]):
        raise _Irregular


_HEAD_TAIL: Final = cap.RECORD_HEAD_SIZE - 14  # rule_name u32 | kind | mode | rule_id u16 | ...


def _check_records(
    buf: np.ndarray,
    heads: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    payloads: bool,
    is_string: np.ndarray,
    is_record: np.ndarray,
) -> None:
    """Each record's head as ``scan_segment_untrusted`` checks it, all at once."""
    if len(starts) == 0:
        return
    if np.any(lengths < cap.RECORD_HEAD_SIZE):
        raise _Irregular
    tail = heads[:, _HEAD_TAIL:]
    rule_name = tail[:, 0:4].copy().view(_BE_U32)[:, 0].astype(np.int64)
    mode = tail[:, 5]
    flags = tail[:, 8]
    count = tail[:, 9].astype(np.int64)
    payload_len = tail[:, 10:14].copy().view(_BE_U32)[:, 0].astype(np.int64)
    has_payload = (flags & cap.RecordFlag.PAYLOAD) != 0
    if (
        np.any(lengths != cap.RECORD_HEAD_SIZE + 4 * count + payload_len)
        or np.any(mode > int(cap.MODE_MAX))
        or np.any(flags & (0xFF & ~cap.RECORD_FLAGS_KNOWN))
        or (not payloads and np.any(has_payload))
        or np.any(payload_len[~has_payload])
    ):
        raise _Irregular
    # string ids: below the count of strings defined before the record
    defined = np.cumsum(is_string)[is_record]
    if np.any(rule_name >= defined):
        raise _Irregular
    if np.any(count):
        record = np.repeat(np.arange(len(starts)), count)
        within = np.arange(len(record), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        ids = u32_at(buf, starts[record] + cap.RECORD_HEAD_SIZE + 4 * within).astype(np.int64)
        if np.any(ids >= defined[record]):
            raise _Irregular
