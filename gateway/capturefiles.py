"""The capture's segment files: one open segment per stream, rotation, retention.

Only the capture's worker thread uses a :class:`CaptureFiles` (one call at a
time, from ``trio.to_thread.run_sync``): it turns the items the data-path
hooks batched into :class:`protocol.capture.CaptureRecord` (decoding forwarded
payloads, grouping a replicated event's inner commands by mode and kind),
appends them to one open segment per stream through protocol/capture.py's
:class:`~protocol.capture.CaptureWriter`, and writes each segment's buffer in
one ``write``.  The byte layout is protocol/capture.py's alone.

Segments are named ``SITE-NODE-STREAM-NNNNNN.cap``; they rotate when they
reach ``segment_max_bytes``, get older than ``segment_max_age_s``, or when
the writer's role or incarnation changes (the header records them).  After
each write the oldest closed segments of this sidecar are deleted while its
segments exceed ``retention_bytes``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final

from gateway.captureconfig import CaptureConfig
from gateway.capturerecords import RuleOf, replicated_records, resync_record
from protocol import cluster as pc
from protocol.capture import CaptureRecord, CaptureRole, CaptureWriter, SegmentHeader, Stream
from protocol.errors import DrgateError

__all__ = ["CaptureFiles", "Item"]

SEGMENT_SUFFIX: Final = ".cap"
_SEGMENT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{6,})\.cap$")

# What the hooks batch: ("r", stream, record) a ready record; ("f", wall_time_us,
# seq, payload, wire_size) a forwarded event; ("i", wall_time_us, cseq, cmd) a
# Replicated, ResyncCommit or ResyncApply D applied.
Item = tuple[Any, ...]


@dataclass(slots=True)
class _Open:
    path: Path
    file: BinaryIO
    writer: CaptureWriter
    opened_s: float
    role: CaptureRole
    incarnation: int


class CaptureFiles:
    """The open and closed segments of one sidecar's capture directory.

    Counters (``records``, ``segments_closed``, ``segments_deleted``,
    ``bytes_written``, ``last_error``) may be read from another thread for
    statistics; everything else belongs to the worker thread.
    """

    def __init__(self, config: CaptureConfig, *, site: str, node: int, rule_of: RuleOf) -> None:
        self.config = config
        self.site = site
        self.node = node
        self._rule_of = rule_of
        self._open: dict[Stream, _Open] = {}
        self._closed: deque[tuple[Path, int]] = deque()  # oldest first
        self._next_index = 0
        self._prefix = f"{site}-{node}-"
        self._prepared = False
        self.records: Counter[str] = Counter()
        self.segments_closed = 0
        self.segments_deleted = 0
        self.bytes_written = 0
        self.last_error = ""

    @property
    def segments_open(self) -> int:
        return len(self._open)

    def prepare(self) -> None:
        """Create the directory and list this sidecar's segments left by earlier runs."""
        if self._prepared:
            return
        directory = Path(self.config.directory)
        directory.mkdir(parents=True, exist_ok=True)
        found: list[tuple[int, Path, int]] = []
        for path in directory.iterdir():
            m = _SEGMENT_NAME.match(path.name)
            if m is None or not path.name.startswith(self._prefix):
                continue
            index = int(m["index"])
            found.append((index, path, path.stat().st_size))
            self._next_index = max(self._next_index, index + 1)
        found.sort()
        self._closed.extend((p, s) for _, p, s in found)
        self._prepared = True

    def write(
        self, batch: list[Item], role: CaptureRole, incarnation: int, now: float, closing: bool
    ) -> None:
        """Append ``batch`` to the segments and write it; close every segment if ``closing``.

        Raises ``OSError`` when the disk fails; an item the capture cannot
        decode is skipped and named in ``last_error``.
        """
        self.prepare()
        cfg = self.config
        # A role or incarnation change starts new segments: the header says who wrote them.
        for stream, seg in list(self._open.items()):
            if (
                seg.role != role
                or seg.incarnation != incarnation
                or now - seg.opened_s >= cfg.segment_max_age_s
            ):
                self._segment_close(stream, now)
        for item in batch:
            try:
                stream, records = self._records(item)
            except DrgateError as exc:  # a payload the capture cannot read: say, skip
                self.last_error = f"capture skipped an event: {exc}"
                continue
            for record in records:
                current = self._open.get(stream)
                if current is None:
                    current = self._segment_open(stream, role, incarnation, now)
                current.writer.append(record)
                self.records[stream.label] += 1
                if current.writer.size >= cfg.segment_max_bytes:
                    self._segment_close(stream, now)
        for stream, seg in list(self._open.items()):
            if closing:
                self._segment_close(stream, now)
            elif seg.writer.buffered:
                self.bytes_written += seg.writer.buffered
                seg.writer.flush()
                seg.file.flush()
        self._retain()

    def _segment_open(self, stream: Stream, role: CaptureRole, inc: int, now: float) -> _Open:
        name = f"{self._prefix}{stream.label}-{self._next_index:06d}{SEGMENT_SUFFIX}"
        self._next_index += 1
        path = Path(self.config.directory) / name
        fh = path.open("xb")
        header = SegmentHeader(
            site=self.site,
            node=self.node,
            role=role,
            stream=stream,
            start_time_us=int(now * 1e6),
            incarnation=inc,
            payloads=self.config.payloads,
        )
        seg = _Open(path, fh, CaptureWriter(fh, header), now, role, inc)
        self._open[stream] = seg
        return seg

    def _segment_close(self, stream: Stream, now: float) -> None:
        seg = self._open.pop(stream)
        before = seg.writer.size - seg.writer.buffered
        try:
            seg.writer.close(int(now * 1e6))
            self.bytes_written += seg.writer.size - before
        finally:
            seg.file.close()
        self._closed.append((seg.path, seg.writer.size))
        self.segments_closed += 1

    def _records(self, item: Item) -> tuple[Stream, list[CaptureRecord]]:
        tag = item[0]
        if tag == "r":
            return item[1], [item[2]]
        payloads = self.config.payloads
        if tag == "f":
            _, now_us, seq, payload, wire = item
            records: list[CaptureRecord] = []
            for cmd in pc.decode_frame_untrusted(payload):
                if isinstance(cmd, pc.Replicated):
                    records += replicated_records(
                        cmd,
                        wall_time_us=now_us,
                        cseq=seq,
                        size=len(payload),
                        wire_size=wire,
                        rule_of=self._rule_of,
                        payload=bytes(payload) if payloads else None,
                        origin=True,
                    )
            return Stream.FORWARDED, records
        _, now_us, cseq, cmd = item
        encoded = pc.encode_frame([cmd])
        if not isinstance(cmd, pc.Replicated):
            installed = resync_record(
                cmd, wall_time_us=now_us, cseq=cseq, size=len(encoded),
                payload=encoded if payloads else None,
            )  # fmt: skip
            return Stream.INGESTED, [installed]
        return Stream.INGESTED, replicated_records(
            cmd,
            wall_time_us=now_us,
            cseq=cseq,
            size=len(encoded),
            wire_size=0,
            rule_of=self._rule_of,
            payload=encoded if payloads else None,
            origin=True,
        )

    def _retain(self) -> None:
        total = sum(s for _, s in self._closed) + sum(
            seg.writer.size for seg in self._open.values()
        )
        while self._closed and total > self.config.retention_bytes:
            path, size = self._closed.popleft()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            total -= size
            self.segments_deleted += 1
