"""The divergent tail of a forced failover (gateway/divergence.py): the events
of a primary's spool above the DR site's last applied cseq, read without
touching the spool, summarized per queue and recorded as a capture."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.divergence import missing_ranges, read_tail, summarize, write_capture
from gateway.spool import Spool
from gateway.spoolfile import FsyncPolicy, segment_paths
from protocol import cluster as pc
from protocol.capture import CaptureReader, Stream
from protocol.errors import DrgateError
from tests.gateway.test_tap import SA, Site


def spooled(site: Site, spool: Spool, *commands: pc.Command) -> None:
    for cmd in commands:
        event = site.run(cmd)
        if event is not None:
            spool.append(event.seq, event.time_us, event.payload, event.prev_seq)


def publish(queue: str, n: int, prefix: str) -> list[pc.Command]:
    return [pc.Publish("", queue, b"x", f"{prefix}-{i}") for i in range(n)]


def primary(tmp_path: Path) -> tuple[Site, Spool, int]:
    """A primary whose spool holds everything; the DR site applied up to the
    returned cseq (three messages of f.q), then the rest stayed at P."""
    site = Site()
    spool = Spool.open(
        tmp_path / "spool", max_bytes=1 << 20, segment_bytes=4096, fsync=FsyncPolicy.NEVER,
        incarnation=42, start_after=site.state.cseq,
    )  # fmt: skip
    spooled(site, spool, pc.QueueDeclare("f.q"), pc.QueueDeclare("e.q"), *publish("f.q", 3, "a"))
    applied = site.state.cseq
    spooled(site, spool, *publish("f.q", 40, "t"), *publish("e.q", 10, "te"))
    spooled(site, spool, pc.Acquire("f.q", SA, 1, 2))
    spooled(site, spool, pc.Accept("f.q", SA, tuple(site.positions("f.q")[:2])))
    return site, spool, applied


def test_the_tail_is_every_event_above_the_applied_point_summarized_per_queue(
    tmp_path: Path,
) -> None:
    site, spool, applied = primary(tmp_path)
    events, incarnation = read_tail(tmp_path / "spool", applied)
    assert incarnation == 42
    assert events[0][0] == applied + 1 and events[-1][0] == site.state.cseq
    assert missing_ranges(events, applied) == []
    queues = summarize(events)
    assert list(queues) == ["dr.f.q", "dr.e.q"]
    assert queues["dr.f.q"].published == [f"t-{i}" for i in range(40)]
    assert queues["dr.f.q"].dequeued == 2
    assert queues["dr.e.q"].published == [f"te-{i}" for i in range(10)]
    assert queues["dr.e.q"].dequeued == 0  # enqueue mode: D's own consumers
    spool.close()


def test_reading_the_tail_changes_nothing_and_leaves_out_a_record_being_written(
    tmp_path: Path,
) -> None:
    _site, spool, applied = primary(tmp_path)
    last = segment_paths(tmp_path / "spool")[-1]
    with last.open("ab") as f:
        f.write(b"\x00\x00\x01\x00half a header")  # a record the sidecar is writing
    before = {p: p.read_bytes() for p in segment_paths(tmp_path / "spool")}
    events, _ = read_tail(tmp_path / "spool", applied)
    assert len(events) == 40 + 10 + 1  # the publishes and the accept; acquires do not cross
    assert {p: p.read_bytes() for p in segment_paths(tmp_path / "spool")} == before
    spool.close()


def test_a_tail_the_spool_does_not_hold_whole_names_the_missing_cseqs(tmp_path: Path) -> None:
    _site, spool, applied = primary(tmp_path)
    events, _ = read_tail(tmp_path / "spool", applied)
    later = events[5:]  # as if the spool's floor had risen past the first five
    assert missing_ranges(later, applied) == [(applied + 1, events[4][0])]
    spool.close()


def test_the_tail_is_recorded_as_a_forwarded_capture_with_its_payloads(tmp_path: Path) -> None:
    _site, spool, applied = primary(tmp_path)
    events, incarnation = read_tail(tmp_path / "spool", applied)
    assert incarnation is not None
    written = write_capture(events, tmp_path / "tail", site="site-p", node=1, incarnation=42)
    assert [p.name for p in written] == ["site-p-1-forwarded-000000.cap"]
    with written[0].open("rb") as fh:
        reader = CaptureReader(fh)
        records = list(reader)
    assert reader.header is not None and reader.header.stream == Stream.FORWARDED
    assert reader.header.payloads and reader.complete
    enqueues = [r for r in records if r.kind == pc.Kind.ENQUEUE]
    assert len(enqueues) == 50
    assert {r.queues for r in enqueues} == {("dr.f.q",), ("dr.e.q",)}
    assert [r.origin_cseq for r in records] == [e[0] for e in events]
    assert all(r.origin_incarnation == 42 for r in records)
    spool.close()


def test_a_failback_by_delta_records_the_tail_first_and_refuses_one_not_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.commands._faildelta import export_tail
    from gateway.commands.switchover import Steps

    _site, spool, applied = primary(tmp_path)
    config = SimpleNamespace(spool_dir=str(tmp_path / "spool"), site="site-p", node=1)
    steps = Steps(quiet=False)
    done = export_tail(config, applied, tmp_path / "tail", force=False, steps=steps)  # type: ignore[arg-type]
    assert done["published"] == {"dr.f.q": 40, "dr.e.q": 10} and done["missing"] == []
    assert done["capture"] and all(Path(c).exists() for c in done["capture"])  # type: ignore[union-attr]
    assert "tail: 51 events after cseq" in capsys.readouterr().out
    # The rejoin discards the spools: a tail not whole here is refused
    # (its first segment gone, as an overflow would), unless --force.
    segment_paths(tmp_path / "spool")[0].unlink()
    with pytest.raises(DrgateError, match=r"not whole .* \(missing cseqs \d+\.\.\d+\).*--force"):
        export_tail(config, applied, tmp_path / "none", force=False, steps=steps)  # type: ignore[arg-type]
    assert not (tmp_path / "none").exists()
    forced = export_tail(config, applied, tmp_path / "forced", force=True, steps=steps)  # type: ignore[arg-type]
    assert forced["missing"] and forced["capture"]
    spool.close()
