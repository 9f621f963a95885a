"""The divergent tail of a forced failover: what the old primary accepted
after the last of its events the DR site applied (docs/operations.md,
"What a failover discarded").

Theory of operation
-------------------
A primary's sidecars spool every event until the DR site acknowledges it,
so after a forced promotion the events the DR site never applied are in
the old primary's spools: those above the DR site's last applied cseq of
it (``drgate promote`` prints it, and so does the split brain's refusal).
:func:`read_tail` reads them from a spool directory without taking its
lock or changing a byte (a running sidecar may be writing its last
record: a record not whole yet is left out), following each event's
``prev_seq`` so that a tail the spool does not hold whole (an overflow, a
sidecar that was down) is reported, never passed off as complete.
:func:`summarize` counts per queue what the tail did (messages published
with their ids, dequeues, declares, deletes, bindings), and
:func:`write_capture` records it as a ``forwarded`` capture stream, with
payloads, that ``drgate analyze`` reads like any capture.  Pure but for the
files read and written.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gateway.captureconfig import CaptureConfig
from gateway.capturefiles import CaptureFiles
from gateway.spoolfile import (
    HEADER_SIZE,
    HEADER_STRUCT,
    PREAMBLE_SIZE,
    Event,
    read_preamble,
    record_crc,
    segment_paths,
)
from protocol import cluster as pc
from protocol.capture import CaptureRole, Stream
from protocol.errors import DrgateError


def read_tail(directory: Path, after: int) -> tuple[list[Event], int | None]:
    """The events of the spool in ``directory`` above ``after``, in order, and
    the spool's incarnation (None: no segment).  Read-only."""
    events: list[Event] = []
    incarnation: int | None = None
    for path in segment_paths(directory):
        head = read_preamble(path)
        if head is None or head[1] is None:
            continue  # cut before its preamble, or another format: nothing to read
        if incarnation not in (None, head[1]):
            raise DrgateError(
                f"{directory}: segments of two incarnations ({incarnation:#x} and "
                f"{head[1]:#x}); is this one sidecar's spool directory?"
            )
        incarnation = head[1]
        events.extend(_records_above(path.read_bytes(), after))
    return events, incarnation


def _records_above(data: bytes, after: int) -> Iterator[Event]:
    offset = PREAMBLE_SIZE
    while offset + HEADER_SIZE <= len(data):
        length, crc, seq, prev_seq, time_us = HEADER_STRUCT.unpack_from(data, offset)
        end = offset + HEADER_SIZE + length
        if end > len(data):
            return  # being written: not whole yet
        payload = data[offset + HEADER_SIZE : end]
        if record_crc(seq, prev_seq, time_us, payload) != crc:
            return  # torn or being written: the rest is not trusted
        if seq > after:
            yield seq, time_us, payload, prev_seq
        offset = end


def missing_ranges(events: list[Event], after: int) -> list[tuple[int, int]]:
    """The cseq ranges above ``after`` that the tail may miss: where an
    event's ``prev_seq`` is above the event before it (or above ``after``
    for the first)."""
    missing, last = [], after
    for seq, _time_us, _payload, prev_seq in events:
        if prev_seq > last:
            missing.append((last + 1, prev_seq))
        last = seq
    return missing


@dataclass(slots=True)
class QueueTail:
    """What the tail did to one queue (by its name at the DR site)."""

    events: int = 0
    published: list[str] = field(default_factory=list)  # message ids, in order
    dequeued: int = 0  # positions taken by consumers or purged
    other: dict[str, int] = field(default_factory=dict)  # declares, deletes, bindings...


def summarize(events: list[Event]) -> dict[str, QueueTail]:
    """Per queue, what the tail's events did, queues in first-touched order."""
    queues: dict[str, QueueTail] = {}
    for _seq, _time_us, payload, _prev in events:
        for cmd in pc.decode_frame_untrusted(payload):
            if not isinstance(cmd, pc.Replicated):
                continue
            touched: set[str] = set()
            for inner in cmd.commands:
                q = queues.setdefault(inner.key, QueueTail())
                touched.add(inner.key)
                if isinstance(inner, pc.Enqueue):
                    q.published.append(inner.message_id)
                elif isinstance(inner, pc.Dequeue):
                    q.dequeued += len(inner.positions)
                else:
                    kind = pc.Kind(inner.KIND).name.lower()
                    q.other[kind] = q.other.get(kind, 0) + 1
            for name in touched:
                queues[name].events += 1
    return queues


@dataclass(slots=True)
class Tail:
    """A sidecar's divergent tail above ``after``, as read from its spool."""

    after: int
    events: list[Event]
    incarnation: int | None
    missing: list[tuple[int, int]]  # cseq ranges the spool does not hold
    queues: dict[str, QueueTail]

    def record(self, out: Path, *, site: str, node: int) -> list[Path]:
        """Write it under ``out`` as a capture; the files written (none for
        an empty tail)."""
        out.mkdir(parents=True, exist_ok=True)
        if not self.events or self.incarnation is None:
            return []
        return write_capture(self.events, out, site=site, node=node, incarnation=self.incarnation)


def tail_of(spool_dir: str, after: int) -> Tail:
    """The tail of the spool in ``spool_dir`` (a sidecar config's
    ``spool.directory``) above ``after``, summarized.  Read-only."""
    directory = Path(spool_dir)
    if not directory.is_dir():
        raise DrgateError(f"{directory} (the config's spool.directory) is not a directory")
    events, incarnation = read_tail(directory, after)
    return Tail(after, events, incarnation, missing_ranges(events, after), summarize(events))


def write_capture(
    events: list[Event], out: Path, *, site: str, node: int, incarnation: int
) -> list[Path]:
    """Record ``events`` under ``out`` as a ``forwarded`` capture stream with
    payloads (``drgate analyze`` reads it); the segment files written."""
    config = CaptureConfig(directory=str(out), streams=frozenset({Stream.FORWARDED}), payloads=True)
    files = CaptureFiles(config, site=site, node=node, rule_of=lambda _queue: None)
    batch = [("f", time_us, seq, payload, 0) for seq, time_us, payload, _prev in events]
    files.write(batch, CaptureRole.EGRESS, incarnation, time.time(), closing=True)
    if files.last_error:
        raise DrgateError(f"the tail's capture under {out}: {files.last_error}")
    return sorted(out.glob(f"{site}-{node}-*.cap"))
