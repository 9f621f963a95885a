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
(``trio.to_thread.run_sync``), where gateway/capturefiles.py turns the items
into records (gateway/capturerecords.py says which records, per stream) and
writes them to one open segment per stream, rotating and deleting segments
by the :class:`~gateway.captureconfig.CaptureConfig`.  Only that thread
touches the writers and files, and only one flush runs at a time.  The
segments' byte layout is protocol/capture.py's; nothing here encodes it.

On cancellation (shutdown) a last, shielded flush writes every segment's
trailer.  A crash leaves the open segments cut: :mod:`protocol.capture` reads
a cut segment up to its last whole record, and everything flushed before the
crash is there.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import trio

from cluster import state as st
from filters.matcher import Decision, RuleSet
from gateway.captureconfig import CaptureConfig, load_capture
from gateway.capturefiles import CaptureFiles, Item
from gateway.capturerecords import tapped_records, without_payload
from gateway.roles import SidecarRole
from protocol import cluster as pc
from protocol.capture import CaptureRecord, CaptureRole, Stream
from protocol.errors import DrgateError

__all__ = [
    "CaptureConfig",
    "CaptureSink",
    "Ingested",
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

_ROLES: Final[dict[str, CaptureRole]] = {
    SidecarRole.EGRESS: CaptureRole.EGRESS,
    SidecarRole.INGRESS: CaptureRole.INGRESS,
    SidecarRole.STANDBY: CaptureRole.STANDBY,
    SidecarRole.INGRESS_STANDBY: CaptureRole.STANDBY,
}


# What the ingested stream records: the forwarded events D applied, and the
# resyncs it installed.
Ingested = pc.Replicated | pc.ResyncCommit | pc.ResyncApply


def capture_role(role: str) -> CaptureRole:
    """The capture role of a sidecar role (``Sidecar.current_role()``)."""
    return _ROLES.get(role, CaptureRole.UNKNOWN)


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
        self._files = CaptureFiles(config, site=site, node=node, rule_of=self._rule_of)
        self._clock = clock
        self._max_batch = max_batch
        self._batch: list[Item] = []
        # forwarded events queued in the current LinkSender, not yet in a batch frame
        self._fwd_sender: object | None = None
        self._fwd_pending: deque[tuple[int, bytes]] = deque()
        self._fwd_events = 0
        self._fwd_wire = 0
        # counters (read by statistics(); the files keep theirs)
        self.dropped: Counter[str] = Counter()
        self.write_errors = 0

    def _rule_of(self, queue: str) -> Decision | None:
        return None if self._rules is None else self._rules().decisions.get(queue)

    def wants(self, stream: Stream) -> bool:
        return stream in self.config.streams

    # -- hooks (trio thread, never block) ------------------------------------

    def _push(self, stream: Stream, item: Item) -> bool:
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
            record = without_payload(record)
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

    def ingested(self, cmd: Ingested, effects: Iterable[Any], cseq: int) -> None:
        """D: this node applied ``cmd`` (an event, or a resync's installation) at
        ``cseq``, whichever sidecar multicast it: every D sidecar records it."""
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
        await trio.to_thread.run_sync(self._files.prepare)
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
            await trio.to_thread.run_sync(self._files.write, batch, role, incarnation, now, closing)
        except (OSError, DrgateError) as exc:
            # The capture must not take the sidecar down: count, say, carry on.
            # (One field holds the newest error, the files' or this one.)
            self.write_errors += 1
            self._files.last_error = f"capture in {self.config.directory}: {exc}"
            log.warning("%s", self._files.last_error)

    def statistics(self) -> dict[str, Any]:
        files = self._files
        return {
            "records_total": dict(files.records),
            "dropped_total": dict(self.dropped),
            "segments_open": files.segments_open,
            "segments_closed_total": files.segments_closed,
            "segments_deleted_total": files.segments_deleted,
            "bytes_written_total": files.bytes_written,
            "write_errors_total": self.write_errors,
            "batched": len(self._batch),
            "last_error": files.last_error,
        }
