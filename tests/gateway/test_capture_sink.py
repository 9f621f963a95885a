"""gateway.capture: the sidecar's capture sink (batching, rotation, retention, close, cut)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from cluster import state as st
from filters.yamldoc import Problems, parse
from gateway.capture import CaptureConfig, CaptureSink, load_capture
from protocol import cluster as pc
from protocol.capture import CaptureReader, CaptureRecord, CaptureRole, Stream
from protocol.errors import ConfigError
from protocol.modes import Mode


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def rec(cseq: int, queue: str = "orders") -> CaptureRecord:
    return CaptureRecord(
        wall_time_us=1_700_000_000_000_000 + cseq,
        cseq=cseq,
        kind=int(pc.Kind.PUBLISH),
        mode=Mode.FULL,
        queues=(queue,),
        size=100,
    )


def config(tmp_path: Path, **kw: object) -> CaptureConfig:
    return CaptureConfig(directory=str(tmp_path / "cap"), **kw)  # type: ignore[arg-type]


def segments(directory: Path) -> Iterator[tuple[Path, CaptureReader, list[CaptureRecord]]]:
    for path in sorted(directory.glob("*.cap")):
        with path.open("rb") as fh:
            reader = CaptureReader(fh)
            records = list(reader)
        yield path, reader, records


def sink_for(tmp_path: Path, clock: Clock | None = None, **kw: object) -> CaptureSink:
    max_batch = kw.pop("max_batch", 10_000)
    return CaptureSink(
        config(tmp_path, **kw),
        site="site-p",
        node=2,
        identity=lambda: (CaptureRole.EGRESS, 77),
        clock=clock or Clock(),
        max_batch=int(max_batch),  # type: ignore[call-overload]
    )


async def test_record_never_writes_and_serve_flushes_in_batches(tmp_path: Path) -> None:
    # Real time: the flush runs in a worker thread, which a virtual clock would outrun.
    sink = sink_for(tmp_path)
    for i in range(1, 6):
        assert sink.record(Stream.TAPPED, rec(i))
    assert not (tmp_path / "cap").exists()  # nothing touched the disk yet
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.serve)
        with trio.fail_after(30):
            # the worker thread's progress has no event to wait on: poll it
            while not sink.statistics()["bytes_written_total"]:  # noqa: ASYNC110
                await trio.sleep(0.02)
        [(path, reader, records)] = list(segments(tmp_path / "cap"))
        assert [r.cseq for r in records] == [1, 2, 3, 4, 5]
        assert reader.cut  # still open: no trailer yet, yet every flushed record reads
        assert path.name == "site-p-2-tapped-000000.cap"
        assert reader.header is not None
        assert (reader.header.role, reader.header.incarnation) == (CaptureRole.EGRESS, 77)
        nursery.cancel_scope.cancel()
    [(_, reader, records)] = list(segments(tmp_path / "cap"))
    assert reader.complete and len(records) == 5
    assert sink.statistics()["records_total"] == {"tapped": 5}


async def test_full_batch_drops_and_counts(tmp_path: Path) -> None:
    sink = sink_for(tmp_path, max_batch=3)
    results = [sink.record(Stream.TAPPED, rec(i)) for i in range(1, 6)]
    assert results == [True, True, True, False, False]
    assert sink.statistics()["dropped_total"] == {"tapped": 2}
    await sink.flush(closing=True)
    [(_, reader, records)] = list(segments(tmp_path / "cap"))
    assert [r.cseq for r in records] == [1, 2, 3]  # the oldest kept, the newest dropped
    assert reader.complete


async def test_streams_not_configured_are_not_recorded(tmp_path: Path) -> None:
    sink = sink_for(tmp_path, streams=frozenset({Stream.FORWARDED}))
    assert not sink.record(Stream.TAPPED, rec(1))
    await sink.flush(closing=True)
    assert list(segments(tmp_path / "cap")) == []


async def test_rotation_by_size_keeps_every_record_in_order(tmp_path: Path) -> None:
    sink = sink_for(tmp_path, segment_max_bytes=1000)
    for i in range(1, 101):
        sink.record(Stream.TAPPED, rec(i, queue=f"q{i % 3}"))
    await sink.flush(closing=True)
    found = list(segments(tmp_path / "cap"))
    assert len(found) > 5
    assert all(reader.complete for _, reader, _ in found)
    # the bound is crossed by at most one record (and the trailer)
    assert all(path.stat().st_size < 1000 + 200 for path, _, _ in found)
    cseqs = [r.cseq for _, _, records in found for r in records]
    assert cseqs == list(range(1, 101))


async def test_rotation_by_age_and_by_role(tmp_path: Path) -> None:
    clock = Clock()
    role = [CaptureRole.EGRESS]
    sink = CaptureSink(
        config(tmp_path, segment_max_age_s=10.0),
        site="site-p",
        node=1,
        identity=lambda: (role[0], 5),
        clock=clock,
    )
    sink.record(Stream.TAPPED, rec(1))
    await sink.flush()
    clock.now += 5
    sink.record(Stream.TAPPED, rec(2))
    await sink.flush()
    clock.now += 6  # the first segment is now 11 s old
    sink.record(Stream.TAPPED, rec(3))
    await sink.flush()
    role[0] = CaptureRole.STANDBY
    sink.record(Stream.TAPPED, rec(4))
    await sink.flush(closing=True)
    found = list(segments(tmp_path / "cap"))
    assert [[r.cseq for r in records] for _, _, records in found] == [[1, 2], [3], [4]]
    assert [reader.header.role for _, reader, _ in found if reader.header] == [
        CaptureRole.EGRESS,
        CaptureRole.EGRESS,
        CaptureRole.STANDBY,
    ]
    assert all(reader.complete for _, reader, _ in found)


async def test_retention_deletes_the_oldest_segments(tmp_path: Path) -> None:
    sink = sink_for(tmp_path, segment_max_bytes=1000, retention_bytes=3000)
    for i in range(1, 201):
        sink.record(Stream.TAPPED, rec(i))
        if i % 20 == 0:
            await sink.flush()
    await sink.flush(closing=True)
    found = list(segments(tmp_path / "cap"))
    total = sum(path.stat().st_size for path, _, _ in found)
    assert total <= 3000
    assert sink.statistics()["segments_deleted_total"] > 0
    cseqs = [r.cseq for _, _, records in found for r in records]
    assert cseqs[-1] == 200 and cseqs == list(range(cseqs[0], 201))  # the newest survive


async def test_a_restarted_sink_continues_numbering_and_retention(tmp_path: Path) -> None:
    first = sink_for(tmp_path)
    first.record(Stream.TAPPED, rec(1))
    await first.flush(closing=True)
    second = sink_for(tmp_path)
    second.record(Stream.TAPPED, rec(2))
    await second.flush(closing=True)
    names = [path.name for path, _, _ in segments(tmp_path / "cap")]
    assert names == ["site-p-2-tapped-000000.cap", "site-p-2-tapped-000001.cap"]


async def test_crash_cut_segment_reads_up_to_its_last_whole_record(tmp_path: Path) -> None:
    sink = sink_for(tmp_path)
    for i in range(1, 11):
        sink.record(Stream.TAPPED, rec(i))
    await sink.flush()  # the process dies here: no trailer, and a torn last write
    [path] = list((tmp_path / "cap").glob("*.cap"))
    data = path.read_bytes()
    cut = tmp_path / "cut.cap"
    cut.write_bytes(data[:-5])
    with cut.open("rb") as fh:
        reader = CaptureReader(fh)
        records = list(reader)
    assert [r.cseq for r in records] == list(range(1, 10))
    assert reader.cut and not reader.complete
    await sink.flush(closing=True)  # (the test's own process goes on: close the file)


@dataclass
class SenderStats:
    events: int
    bytes_sent: int


def replicated(cseq: int) -> tuple[pc.Replicated, bytes]:
    cmd = pc.Replicated(
        "site-p",
        77,
        cseq,
        1,
        1_700_000_000_000_000,
        (Mode.FULL, Mode.ENQUEUE, Mode.FULL),
        (
            pc.Enqueue("orders", 3, b"x" * 50, "m-1", {}),
            pc.Enqueue("billing", 9, b"x" * 50, "m-1", {}),
            pc.Enqueue("audit", 4, b"x" * 50, "m-1", {}),
        ),
    )
    return cmd, pc.encode_frame([cmd])


async def test_forwarded_records_carry_their_share_of_the_wire(tmp_path: Path) -> None:
    sink = sink_for(tmp_path)
    sender = object()
    payloads = {seq: replicated(seq)[1] for seq in (11, 12, 13)}
    for seq, payload in payloads.items():
        sink.forwarded(sender, seq, payload)
    sink.forwarded_sent(sender, SenderStats(events=2, bytes_sent=300))  # 11, 12 left
    sink.forwarded(object(), 14, replicated(14)[1])  # a new link: 13 was never sent
    await sink.flush(closing=True)
    [(_, reader, records)] = list(segments(tmp_path / "cap"))
    assert reader.header is not None and reader.header.stream is Stream.FORWARDED
    # one record per (event, mode, kind): full (orders, audit) and enqueue (billing)
    assert [(r.cseq, r.mode, r.queues) for r in records] == [
        (11, Mode.FULL, ("orders", "audit")),
        (11, Mode.ENQUEUE, ("billing",)),
        (12, Mode.FULL, ("orders", "audit")),
        (12, Mode.ENQUEUE, ("billing",)),
    ]
    assert all(r.kind == pc.Kind.ENQUEUE for r in records)
    assert all((r.origin_cseq, r.origin_incarnation) == (r.cseq, 77) for r in records)
    assert sum(r.wire_size for r in records) == 300
    assert sum(r.size for r in records if r.cseq == 11) == len(payloads[11])


async def test_ingested_records_only_applications(tmp_path: Path) -> None:
    sink = sink_for(tmp_path, streams=frozenset({Stream.INGESTED}))

    def outcome(cmd: pc.Replicated, o: st.Outcome) -> list[object]:
        return [st.ReplicatedOutcome(cmd.origin_cluster, cmd.incarnation, cmd.origin_cseq, 1, o)]

    applied, _ = replicated(21)
    duplicate, _ = replicated(20)
    sink.ingested(applied, outcome(applied, st.Outcome.APPLIED), cseq=500)
    sink.ingested(duplicate, outcome(duplicate, st.Outcome.DUPLICATE), cseq=501)
    await sink.flush(closing=True)
    [(_, _, records)] = list(segments(tmp_path / "cap"))
    assert {(r.cseq, r.origin_cseq, r.origin_incarnation) for r in records} == {(500, 21, 77)}
    assert sorted(q for r in records for q in r.queues) == ["audit", "billing", "orders"]


async def test_ingested_records_a_resync_installed_not_one_refused(tmp_path: Path) -> None:
    sink = sink_for(tmp_path, streams=frozenset({Stream.INGESTED}))
    installed = pc.ResyncCommit("site-p", 77, 4000, 1, 0, 3)
    refused = pc.ResyncApply("site-p", 77, 3000, 1, 0, b"")

    def outcome(cmd: pc.ResyncCommit | pc.ResyncApply, o: st.Outcome) -> list[object]:
        return [st.ReplicatedOutcome(cmd.origin_cluster, cmd.incarnation, cmd.cut, 1, o)]

    sink.ingested(installed, outcome(installed, st.Outcome.APPLIED), cseq=600)
    sink.ingested(refused, outcome(refused, st.Outcome.DUPLICATE), cseq=601)
    await sink.flush(closing=True)
    [(_, _, [record])] = list(segments(tmp_path / "cap"))
    assert (record.cseq, record.origin_cseq, record.origin_incarnation) == (600, 4000, 77)
    assert record.resync and record.queues == () and record.kind == pc.Kind.RESYNC_COMMIT


async def test_write_errors_are_counted_not_raised(tmp_path: Path) -> None:
    (tmp_path / "cap").write_text("a file where the directory should be")
    sink = sink_for(tmp_path)
    sink.record(Stream.TAPPED, rec(1))
    await sink.flush()
    assert sink.statistics()["write_errors_total"] == 1
    assert "capture in" in sink.statistics()["last_error"]


def capture_node(text: str) -> object:
    return parse(text, "sidecar.yaml", error=ConfigError).value["capture"]


def test_load_capture_defaults_and_values() -> None:
    problems = Problems()
    cfg = load_capture(
        capture_node(  # type: ignore[arg-type]
            "capture:\n  directory: /var/cap\n  streams: [forwarded, ingested]\n"
            "  payloads: true\n  segment_max_bytes: 1048576\n  retention_bytes: 8388608\n"
        ),
        problems,
    )
    assert not problems.errors
    assert cfg == CaptureConfig(
        directory="/var/cap",
        streams=frozenset({Stream.FORWARDED, Stream.INGESTED}),
        payloads=True,
        segment_max_bytes=1048576,
        retention_bytes=8388608,
    )


@pytest.mark.parametrize(
    ("body", "line", "message"),
    [
        ("  directory: /c\n  streams: [tapped, sent]\n", 3, "unknown capture stream 'sent'"),
        ("  directory: /c\n  segment_max_byte: 9000\n", 3, "did you mean 'segment_max_bytes'"),
        ("  streams: [tapped]\n", 2, "directory"),
        (
            "  directory: /c\n  segment_max_bytes: 1048576\n  retention_bytes: 65536\n",
            4,
            "retention_bytes",
        ),
    ],
)
def test_load_capture_errors_name_the_line(body: str, line: int, message: str) -> None:
    problems = Problems()
    node = capture_node("capture:\n" + body)
    assert load_capture(node, problems) is None  # type: ignore[arg-type]
    assert problems.errors
    assert any(p.location.line == line and message in str(p) for p in problems.errors), [
        str(p) for p in problems.errors
    ]
