"""Capture in the sidecar: what it tapped, forwarded and ingested, written as segments.

Theory of operation
-------------------
The sidecar's data path calls the hooks of :class:`CaptureSink`
(:meth:`~CaptureSink.tapped`, :meth:`~CaptureSink.forwarded` and
:meth:`~CaptureSink.forwarded_sent`, :meth:`~CaptureSink.ingested`, or the
generic :meth:`~CaptureSink.record`).  They are synchronous, never wait and
never touch a file: they append a small tuple to an in-memory batch.  The
batch is bounded (:data:`MAX_BATCH_ITEMS`); when it is full the new item is
*dropped and counted* (``dropped`` in :meth:`~CaptureSink.statistics`):
capture is for audit after the fact and must never slow replication down or
grow without bound.  A capture with drops is incomplete, and says so.

:meth:`CaptureSink.serve` swaps the batch out every
:data:`FLUSH_INTERVAL_S` and hands it to a worker thread
(``trio.to_thread.run_sync``), which turns the items into
:class:`protocol.capture.CaptureRecord` (decoding forwarded payloads, grouping
a replicated event's inner commands by mode and kind), appends them to one
open segment per stream and writes each segment's buffer in one ``write``.
Only that thread touches the writers and files, and only one flush runs at a
time.

Segments rotate when they reach ``segment_max_bytes``, get older than
``segment_max_age_s``, or when the sidecar's role changes (the header records
the role).  After each flush the oldest closed segments of this sidecar are
deleted while its segments exceed ``retention_bytes``.  On cancellation
(shutdown) a last, shielded flush writes every segment's trailer.  A crash
leaves the open segments cut: :mod:`protocol.capture` reads a cut segment up
to its last whole record, and everything flushed before the crash is there.

Record shapes, per stream:

* ``tapped``: one record per (command, mode, rule) -- every bus command the
  tap saw, with the queues it touched grouped by the rules' decision (mode
  ``none`` means the rules filtered the queue: the record says by which rule).
  ``kind`` is P's command kind; ``size`` is the event's bytes (0 when nothing
  was forwarded; the body length for a filtered publish).
* ``forwarded``: one record per (event, mode, kind of inner command): the
  event's ``Replicated`` as the egress sent it, ``cseq``/``origin_cseq`` = the
  event's sequence number, ``origin_incarnation`` = P's incarnation;
  ``size`` is the event's encoded bytes and ``wire_size`` its share of the
  compressed link batches sent with it (split across groups).
* ``ingested``: the same grouping, at D, for each ``Replicated`` the active
  ingress multicast and D applied (outcome ``applied``; a refused duplicate
  is not an application); ``cseq`` is D's cseq of the application.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final

import trio

from cluster import state as st
from filters.matcher import Decision, RuleSet
from filters.yamldoc import Node, Problems, check_keys, expect_bool, expect_int, expect_str
from protocol import cluster as pc
from protocol.capture import (
    NO_RULE,
    CaptureRecord,
    CaptureRole,
    CaptureWriter,
    SegmentHeader,
    Stream,
)
from protocol.errors import DrgateError
from protocol.modes import Mode

__all__ = [
    "CaptureConfig",
    "CaptureSink",
    "capture_role",
    "load_capture",
]

log = logging.getLogger("drgate.capture")

# 200 ms: a record reaches the file within a fraction of a second (a crash
# loses little) while a busy sidecar still writes a few large blocks a second.
FLUSH_INTERVAL_S: Final = 0.2
# Items held between two flushes.  200 000 per 200 ms is a million events a
# second, far above a sidecar's rate; beyond it the capture drops (counted)
# rather than grow the sidecar's memory.
MAX_BATCH_ITEMS: Final = 200_000
# 64 MiB segments: a minute or more of a busy site, small enough for one Spark
# partition each.
DEFAULT_SEGMENT_MAX_BYTES: Final = 64 * 1024 * 1024
# Five minutes: a quiet site's segments still close (and become complete) often.
DEFAULT_SEGMENT_MAX_AGE_S: Final = 300.0
# 4 GiB per sidecar unless told otherwise.
DEFAULT_RETENTION_BYTES: Final = 4 * 1024 * 1024 * 1024
MIN_SEGMENT_BYTES: Final = 4096
STREAM_NAMES: Final = {s.label: s for s in Stream}
SEGMENT_SUFFIX: Final = ".cap"

_ROLES: Final = {
    "egress": CaptureRole.EGRESS,
    "ingress": CaptureRole.INGRESS,
    "standby": CaptureRole.STANDBY,
    "ingress-standby": CaptureRole.STANDBY,
}


def capture_role(role: str) -> CaptureRole:
    """The capture role of a sidecar role name (``Sidecar.current_role()``)."""
    return _ROLES.get(role, CaptureRole.UNKNOWN)


@dataclass(frozen=True, slots=True)
class CaptureConfig:
    """The sidecar config's ``capture:`` section."""

    directory: str
    streams: frozenset[Stream] = frozenset(Stream)
    payloads: bool = False
    segment_max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES
    segment_max_age_s: float = DEFAULT_SEGMENT_MAX_AGE_S
    retention_bytes: int = DEFAULT_RETENTION_BYTES


def load_capture(node: Node, problems: Problems) -> CaptureConfig | None:
    """Parse the ``capture:`` section; mistakes go to ``problems`` (file:line:column).

    Example::

        capture:
          directory: /var/lib/drgate/capture
          streams: [tapped, forwarded, ingested]   # default: all three
          payloads: false                          # record the commands' bytes too
          segment_max_bytes: 67108864
          segment_max_age_s: 300
          retention_bytes: 4294967296
    """
    errors_before = len(problems.errors)
    fields = check_keys(
        node,
        problems,
        what="'capture'",
        required=("directory",),
        optional=(
            "streams",
            "payloads",
            "segment_max_bytes",
            "segment_max_age_s",
            "retention_bytes",
        ),
    )
    if fields is None:
        return None
    ok = True
    directory = ""
    if "directory" in fields:
        directory = expect_str(fields["directory"], problems, what="'capture.directory'") or ""
        ok = ok and bool(directory)
    streams: set[Stream] = set(Stream)
    if "streams" in fields:
        snode = fields["streams"]
        if snode.kind != "sequence" or not snode.value:
            problems.error(
                snode.location,
                "'capture.streams' must be a non-empty list",
                f"choose from: {', '.join(STREAM_NAMES)}",
            )
            ok = False
        else:
            streams = set()
            for item in snode.value:
                name = expect_str(item, problems, what="each item of 'capture.streams'")
                if name is None:
                    ok = False
                elif name not in STREAM_NAMES:
                    problems.error(
                        item.location,
                        f"unknown capture stream {name!r}",
                        f"use one of: {', '.join(STREAM_NAMES)}",
                    )
                    ok = False
                else:
                    streams.add(STREAM_NAMES[name])
    payloads = False
    if "payloads" in fields:
        value = expect_bool(fields["payloads"], problems, what="'capture.payloads'")
        ok = ok and value is not None
        payloads = bool(value)

    def integer(key: str, default: int, minimum: int) -> int:
        nonlocal ok
        if key not in fields:
            return default
        value = expect_int(fields[key], problems, what=f"'capture.{key}'", minimum=minimum)
        if value is None:
            ok = False
            return default
        return value

    max_bytes = integer("segment_max_bytes", DEFAULT_SEGMENT_MAX_BYTES, MIN_SEGMENT_BYTES)
    max_age = float(integer("segment_max_age_s", int(DEFAULT_SEGMENT_MAX_AGE_S), 1))
    retention = integer("retention_bytes", DEFAULT_RETENTION_BYTES, MIN_SEGMENT_BYTES)
    if retention < max_bytes and "retention_bytes" in fields:
        problems.error(
            fields["retention_bytes"].location,
            f"'capture.retention_bytes' ({retention}) is below 'capture.segment_max_bytes' "
            f"({max_bytes})",
            "keep at least a few segments: retention_bytes >= 2 * segment_max_bytes",
        )
        ok = False
    if not ok or len(problems.errors) > errors_before:
        return None
    return CaptureConfig(
        directory=directory,
        streams=frozenset(streams),
        payloads=payloads,
        segment_max_bytes=max_bytes,
        segment_max_age_s=max_age,
        retention_bytes=retention,
    )


# --- building records ---------------------------------------------------------


def _split(total: int, parts: int) -> list[int]:
    """``total`` split in ``parts`` integers summing to it (remainder first)."""
    base, rest = divmod(total, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


def _rule(decision: Decision | None) -> tuple[int, str]:
    if decision is None or decision.rule_name == "default":
        return NO_RULE, ""
    return min(decision.rule_index, NO_RULE - 1), decision.rule_name


RuleOf = Callable[[str], Decision | None]


def replicated_records(
    cmd: pc.Replicated,
    *,
    wall_time_us: int,
    cseq: int,
    size: int,
    wire_size: int,
    rule_of: RuleOf,
    payload: bytes | None,
    origin: bool,
) -> list[CaptureRecord]:
    """One record per (mode, inner command kind) of a ``Replicated`` event.

    ``origin``: the record names the event's origin (``origin_cseq`` and
    ``origin_incarnation``); always so here, both at P and D.
    """
    groups: dict[tuple[Mode, int], list[str]] = {}
    for mode, inner in zip(cmd.modes, cmd.commands, strict=False):
        queues = groups.setdefault((Mode(mode), int(inner.KIND)), [])
        key = inner.key
        if key not in queues:
            queues.append(key)
    if not groups:
        return []
    sizes = _split(size, len(groups))
    wires = _split(wire_size, len(groups))
    records = []
    for i, ((mode, kind), queues) in enumerate(groups.items()):
        rule_id, rule_name = _rule(rule_of(queues[0])) if queues else (NO_RULE, "")
        records.append(
            CaptureRecord(
                wall_time_us=wall_time_us,
                cseq=cseq,
                kind=kind,
                mode=mode,
                queues=tuple(queues[:255]),
                size=sizes[i],
                wire_size=wires[i],
                origin_cseq=cmd.origin_cseq if origin else 0,
                origin_incarnation=cmd.incarnation if origin else 0,
                rule_id=rule_id,
                rule_name=rule_name,
                payload=payload if i == 0 else (b"" if payload is not None else None),
            )
        )
    return records


def tapped_records(
    cmd: pc.Command,
    effects: Sequence[Any],
    event: Any,
    *,
    cseq: int,
    wall_time_us: int,
    rules: RuleSet,
    payloads: bool,
) -> list[CaptureRecord]:
    """The tapped stream's records for one command (see the module docstring).

    ``event`` is the tap's :class:`gateway.tap.ReplEvent` or ``None``.
    """
    touched: list[str] = []
    for e in effects:
        q = getattr(e, "queue", None)
        if isinstance(q, str) and q not in touched:
            touched.append(q)
    q = getattr(cmd, "queue", None)
    if isinstance(q, str) and q not in touched:
        touched.append(q)
    forwarded_modes: dict[str, Mode] = {}
    if event is not None:
        for mode, name in zip(event.modes, event.queues, strict=False):
            forwarded_modes.setdefault(name, Mode(mode))
    size = len(event.payload) if event is not None else 0
    if event is None and isinstance(cmd, pc.Publish):
        size = len(cmd.body)
    payload = bytes(event.payload) if payloads and event is not None else None
    groups: dict[tuple[Mode, int, str], list[str]] = {}
    for name in touched:
        decision = rules.decisions.get(name)
        target = decision.target_name if decision is not None else name
        mode = forwarded_modes.get(target)
        if mode is None:
            if isinstance(cmd, pc.Publish) and any(
                isinstance(e, st.Enqueued) and e.queue == name for e in effects
            ):
                # A message the tap did not forward: filtered (mode none), whatever
                # the queue's mode (a per-message rule or a message-less mode).
                mode = Mode.NONE if decision is None else decision.mode
                if mode in (Mode.FULL, Mode.ENQUEUE):
                    mode = Mode.NONE  # dropped by a per-message rule (size, header)
            else:
                mode = decision.mode if decision is not None else Mode.NONE
        rule_id, rule_name = _rule(decision)
        groups.setdefault((mode, rule_id, rule_name), []).append(name)
    if not groups:
        mode = Mode.WIRING if event is not None else Mode.NONE
        groups[(mode, NO_RULE, "")] = []
    records = []
    for i, ((mode, rule_id, rule_name), queues) in enumerate(groups.items()):
        records.append(
            CaptureRecord(
                wall_time_us=wall_time_us,
                cseq=cseq,
                kind=int(cmd.KIND),
                mode=mode,
                queues=tuple(queues[:255]),
                size=size if i == 0 else 0,
                rule_id=rule_id,
                rule_name=rule_name,
                payload=(payload if i == 0 else b"") if payload is not None else None,
            )
        )
    return records


# --- the sink -----------------------------------------------------------------

_SEGMENT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{6,})\.cap$")


@dataclass(slots=True)
class _Open:
    path: Path
    file: BinaryIO
    writer: CaptureWriter
    opened_s: float
    role: CaptureRole
    incarnation: int


class CaptureSink:
    """Batches capture records in memory and writes them as segments off the data path.

    ``identity()`` gives the sidecar's current (role, site incarnation) for
    segment headers (called in the trio thread at each flush); ``rules()`` the
    rules in force, whose decisions name the rule of a queue in forwarded and
    ingested records (read by the writer thread: a dict lookup);
    ``clock()`` is wall time in seconds.
    """

    def __init__(
        self,
        config: CaptureConfig,
        *,
        site: str,
        node: int,
        identity: Callable[[], tuple[CaptureRole, int]] | None = None,
        rules: Callable[[], RuleSet] | None = None,
        clock: Callable[[], float] = time.time,
        max_batch: int = MAX_BATCH_ITEMS,
    ) -> None:
        self.config = config
        self.site = site
        self.node = node
        self._identity = identity or (lambda: (CaptureRole.UNKNOWN, 0))
        self._rules = rules
        self._clock = clock
        self._max_batch = max_batch
        self._batch: list[tuple[Any, ...]] = []
        # forwarded events queued in the current LinkSender, not yet in a batch frame
        self._fwd_sender: object | None = None
        self._fwd_pending: deque[tuple[int, bytes]] = deque()
        self._fwd_events = 0
        self._fwd_wire = 0
        # writer thread state
        self._open: dict[Stream, _Open] = {}
        self._closed: deque[tuple[Path, int]] = deque()  # oldest first
        self._next_index = 0
        self._prefix = f"{site}-{node}-"
        self._prepared = False
        # counters (read by statistics())
        self.records: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.segments_closed = 0
        self.segments_deleted = 0
        self.bytes_written = 0
        self.write_errors = 0
        self.last_error = ""

    def _rule_of(self, queue: str) -> Decision | None:
        return None if self._rules is None else self._rules().decisions.get(queue)

    def wants(self, stream: Stream) -> bool:
        return stream in self.config.streams

    # -- hooks (trio thread, never block) ------------------------------------

    def _push(self, stream: Stream, item: tuple[Any, ...]) -> bool:
        if len(self._batch) >= self._max_batch:
            self.dropped[stream.label] += 1
            return False
        self._batch.append(item)
        return True

    def record(self, stream: Stream, record: CaptureRecord) -> bool:
        """Queue one ready-made record; ``False`` if dropped (batch full) or not captured."""
        if stream not in self.config.streams:
            return False
        if record.payload is not None and not self.config.payloads:
            record = _without_payload(record)
        return self._push(stream, ("r", stream, record))

    def tapped(
        self, cmd: pc.Command, effects: Sequence[Any], event: Any, cseq: int, rules: RuleSet
    ) -> None:
        """P: the tap saw ``cmd`` (applied at ``cseq``) and produced ``event`` (or ``None``)."""
        if Stream.TAPPED not in self.config.streams:
            return
        now_us = event.time_us if event is not None else int(self._clock() * 1e6)
        for record in tapped_records(
            cmd,
            effects,
            event,
            cseq=cseq,
            wall_time_us=now_us,
            rules=rules,
            payloads=self.config.payloads,
        ):
            self._push(Stream.TAPPED, ("r", Stream.TAPPED, record))

    def forwarded(self, sender: object, seq: int, payload: bytes) -> None:
        """P: the egress queued event ``seq`` in ``sender`` (a LinkSender).

        The record is made when the event leaves in a batch frame
        (:meth:`forwarded_sent`), with its share of the wire bytes.
        """
        if Stream.FORWARDED not in self.config.streams:
            return
        if sender is not self._fwd_sender:
            self._new_sender(sender)
        if len(self._fwd_pending) >= self._max_batch:
            self.dropped[Stream.FORWARDED.label] += 1
            return
        self._fwd_pending.append((seq, payload))

    def _new_sender(self, sender: object) -> None:
        # Events queued in the previous sender and never batched were not
        # forwarded: the next sender reads them from the spool again.
        self._fwd_sender = sender
        self._fwd_pending.clear()
        self._fwd_events = 0
        self._fwd_wire = 0

    def forwarded_sent(self, sender: object, stats: Any) -> None:
        """P: after ``sender.data_to_send``; ``stats`` is its ``statistics()``.

        The events batched since the last call are the oldest pending ones;
        the wire bytes handed out since then (batch frames, plus the odd ping)
        are shared among them by size.
        """
        if Stream.FORWARDED not in self.config.streams:
            return
        if sender is not self._fwd_sender:
            self._new_sender(sender)
        sent = stats.events - self._fwd_events
        wire = stats.bytes_sent - self._fwd_wire
        if sent <= 0:
            return
        self._fwd_events = stats.events
        self._fwd_wire = stats.bytes_sent
        now_us = int(self._clock() * 1e6)
        batch = [self._fwd_pending.popleft() for _ in range(min(sent, len(self._fwd_pending)))]
        total = sum(len(p) for _, p in batch) or 1
        for seq, payload in batch:
            share = max(1, round(wire * len(payload) / total)) if wire > 0 else 0
            self._push(Stream.FORWARDED, ("f", now_us, seq, payload, share))

    def ingested(self, cmd: pc.Replicated, effects: Iterable[Any], cseq: int) -> None:
        """D: this sidecar's ``Replicated`` came back on D's bus and was applied at ``cseq``."""
        if Stream.INGESTED not in self.config.streams:
            return
        for e in effects:
            if isinstance(e, st.ReplicatedOutcome) and e.outcome is st.Outcome.APPLIED:
                break
        else:
            return  # refused (duplicate, fenced...): not an application
        self._push(Stream.INGESTED, ("i", int(self._clock() * 1e6), cseq, cmd))

    # -- service ---------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Flush every :data:`FLUSH_INTERVAL_S` until cancelled; then close every segment."""
        await trio.to_thread.run_sync(self._prepare)
        task_status.started()
        try:
            while True:
                await trio.sleep(FLUSH_INTERVAL_S)
                await self.flush()
        finally:
            with trio.CancelScope(shield=True):
                await self.flush(closing=True)

    async def flush(self, *, closing: bool = False) -> None:
        """Write what is batched (and close the segments if ``closing``)."""
        batch, self._batch = self._batch, []
        role, incarnation = self._identity()
        now = self._clock()
        try:
            await trio.to_thread.run_sync(self._write, batch, role, incarnation, now, closing)
        except (OSError, DrgateError) as exc:
            # The capture must not take the sidecar down: count, say, carry on.
            self.write_errors += 1
            self.last_error = f"capture in {self.config.directory}: {exc}"
            log.warning("%s", self.last_error)

    def statistics(self) -> dict[str, Any]:
        return {
            "records_total": dict(self.records),
            "dropped_total": dict(self.dropped),
            "segments_open": len(self._open),
            "segments_closed_total": self.segments_closed,
            "segments_deleted_total": self.segments_deleted,
            "bytes_written_total": self.bytes_written,
            "write_errors_total": self.write_errors,
            "batched": len(self._batch),
            "last_error": self.last_error,
        }

    # -- writer thread ---------------------------------------------------------

    def _prepare(self) -> None:
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

    def _records(self, item: tuple[Any, ...]) -> tuple[Stream, list[CaptureRecord]]:
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

    def _write(
        self,
        batch: list[tuple[Any, ...]],
        role: CaptureRole,
        incarnation: int,
        now: float,
        closing: bool,
    ) -> None:
        self._prepare()
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


def _without_payload(record: CaptureRecord) -> CaptureRecord:
    from dataclasses import replace

    return replace(record, payload=None)
