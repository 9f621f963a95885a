"""A simulated two-site run, written as capture segments by protocol/capture's writer.

P taps every event with its rule decision, forwards what the rules keep, and
D applies each forwarded event (its own cseq, interleaved with local traffic
that is not captured).  Faults are injected by editing the plan before the
segments are written.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from protocol.capture import (
    NO_RULE,
    CaptureRecord,
    CaptureRole,
    CaptureWriter,
    SegmentHeader,
    Stream,
)
from protocol.cluster import Kind
from protocol.modes import Mode

INC_P = 0xA1B2C3D4E5F60718
INC_D = 0x0102030405060708
T0 = 1_700_000_000_000_000  # µs

# queue -> (mode, rule id, rule name)
QUEUES = {
    "orders": (Mode.FULL, 0, "orders-full"),
    "billing": (Mode.ENQUEUE, 1, "billing-enqueue"),
    "config": (Mode.WIRING, 2, "config-wiring"),
    "scratch": (Mode.NONE, NO_RULE, ""),
}
REPLICATED = {
    Mode.FULL: None,  # everything
    Mode.ENQUEUE: {Kind.QUEUE_DECLARE, Kind.PUBLISH, Kind.ENQUEUE},
    Mode.WIRING: {Kind.QUEUE_DECLARE, Kind.QUEUE_DELETE, Kind.BIND, Kind.UNBIND},
    Mode.NONE: set(),
}


@dataclass
class Applied:
    """One application at D of a forwarded event."""

    event: CaptureRecord
    lag_us: int
    same_cseq: bool = False  # one more record of the application before it (another kind)


@dataclass
class Run:
    tapped: list[CaptureRecord] = field(default_factory=list)
    forwarded: list[CaptureRecord] = field(default_factory=list)
    applied: list[Applied] = field(default_factory=list)
    resync_cuts: list[int] = field(default_factory=list)  # resyncs D installed, after the events


def forwards(mode: Mode, kind: int) -> bool:
    allowed = REPLICATED[mode]
    return allowed is None or kind in allowed


def plan(events: int = 60) -> Run:
    """A clean run: every queue declared, then publishes and accepts round robin."""
    run = Run()
    names = list(QUEUES)
    script: list[tuple[int, tuple[str, ...]]] = [(int(Kind.QUEUE_DECLARE), (q,)) for q in names]
    for i in range(events - len(script) - 1):
        queue = names[i % len(names)]
        kind = int(Kind.ACCEPT if i % 5 == 4 else Kind.PUBLISH)
        script.append((kind, (queue,)))
    script.append((int(Kind.PUBLISH), ("orders", "billing")))  # one publish routed to two queues
    for n, (kind, queues) in enumerate(script, start=1):
        mode, rule_id, rule_name = QUEUES[queues[0]]
        record = CaptureRecord(
            wall_time_us=T0 + n * 250_000,  # 4 events/s: several 10 s windows
            cseq=n,
            kind=int(kind),
            mode=mode,
            queues=queues,
            size=200 + n,
            wire_size=(200 + n) // 4,
            rule_id=rule_id,
            rule_name=rule_name,
        )
        run.tapped.append(record)
        if forwards(mode, kind):
            run.forwarded.append(record)
            run.applied.append(Applied(record, lag_us=20_000 + (n % 7) * 1_000))
    return run


def segment_bytes(
    header: SegmentHeader, records: list[CaptureRecord], *, end_us: int | None
) -> bytes:
    """A capture segment's bytes, as protocol/capture's writer leaves them.

    Closed with its trailer at ``end_us``; with ``end_us=None`` flushed but not
    closed, as a writer killed after its last flush leaves it (no trailer).
    """
    out = io.BytesIO()
    writer = CaptureWriter(out, header)
    for r in records:
        writer.append(r)
    if end_us is None:
        writer.flush()
    else:
        writer.close(end_us)
    return out.getvalue()


def _header(site: str, node: int, role: CaptureRole, stream: Stream, inc: int) -> SegmentHeader:
    return SegmentHeader(site, node, role, stream, T0, incarnation=inc)


def write(
    run: Run,
    directory: Path,
    *,
    forwarded_segments: int = 2,
    cut_last: bool = False,
    d_nodes: Mapping[int, slice] | None = None,
) -> None:
    """Write P's tapped and forwarded streams and D's ingested stream under ``directory``.

    ``cut_last``: D's segments are left as a writer killed mid-write leaves them.
    ``d_nodes``: which D nodes recorded which part of D's applications (in D's
    order, the resyncs last); by default node 1 recorded them all.
    """
    directory.mkdir(parents=True, exist_ok=True)
    end = T0 + 3_600_000_000

    def segment(name: str, header: SegmentHeader, records: list[CaptureRecord], cut: bool) -> None:
        data = segment_bytes(header, records, end_us=None if cut else end)
        # A cut segment: the last record's block lost its tail.
        (directory / name).write_bytes(data[:-7] if cut else data)

    segment(
        "p1-tapped-0000.cap",
        _header("primary", 1, CaptureRole.EGRESS, Stream.TAPPED, INC_P),
        run.tapped,
        False,
    )
    per = -(-len(run.forwarded) // forwarded_segments)
    for s in range(forwarded_segments):
        segment(
            f"p1-forwarded-{s:04d}.cap",
            _header("primary", 1, CaptureRole.EGRESS, Stream.FORWARDED, INC_P),
            run.forwarded[s * per : (s + 1) * per],
            False,
        )
    ingested = []
    d_cseq = 1000
    for a in run.applied:
        if not a.same_cseq:
            d_cseq += 3  # D's own traffic in between
        ingested.append(
            replace(
                a.event,
                wall_time_us=a.event.wall_time_us + a.lag_us,
                cseq=d_cseq,
                origin_cseq=a.event.cseq,
                origin_incarnation=INC_P,
                wire_size=0,
            )
        )
    ingested.sort(key=lambda r: r.cseq)
    for cut in run.resync_cuts:
        d_cseq += 3
        ingested.append(
            CaptureRecord(
                wall_time_us=end - 1_000_000 + d_cseq,
                cseq=d_cseq,
                kind=int(Kind.RESYNC_COMMIT),
                mode=Mode.FULL,
                origin_cseq=cut,
                origin_incarnation=INC_P,
                resync=True,
            )
        )
    for node, part in (d_nodes or {1: slice(None)}).items():
        role = CaptureRole.INGRESS if node == 1 else CaptureRole.STANDBY
        segment(
            f"d{node}-ingested-0000.cap",
            _header("dr", node, role, Stream.INGESTED, INC_D),
            ingested[part],
            cut_last,
        )


def event(run: Run, kind: int, queue: str, nth: int = 0) -> CaptureRecord:
    """The nth tapped event of ``kind`` on exactly ``queue``."""
    found = [r for r in run.tapped if r.kind == kind and r.queues == (queue,)]
    return found[nth]
