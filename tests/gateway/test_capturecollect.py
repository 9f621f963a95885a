"""gateway/capturecollect and ``drgate capture collect``: a site's segments in one place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.capturecollect import CollectError, collect
from gateway.cli import main
from protocol.capture import CaptureRecord, CaptureRole, SegmentHeader, Stream
from protocol.capturemanifest import MANIFEST_NAME, coverage, parse_manifest_untrusted
from protocol.modes import Mode
from tests.analysis.twosite import segment_bytes

T0 = 1_700_000_000_000_000


def records(n: int, start: int = 1) -> list[CaptureRecord]:
    return [
        CaptureRecord(T0 + i * 1000, i, 7, Mode.FULL, ("orders",), 100)
        for i in range(start, start + n)
    ]


def segment(
    directory: Path,
    name: str,
    *,
    site: str = "site-p",
    node: int = 1,
    stream: Stream = Stream.TAPPED,
    n: int = 5,
    cut: bool = False,
) -> Path:
    header = SegmentHeader(site, node, CaptureRole.EGRESS, stream, T0, incarnation=9)
    data = segment_bytes(header, records(n), end_us=None if cut else T0 + 10**9)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(data[:-5] if cut else data)  # cut: the last record torn
    return path


@pytest.fixture
def sidecars(tmp_path: Path) -> list[Path]:
    """Three sidecars of P, each with its own capture directory; node 1 is the egress."""
    dirs = [tmp_path / f"p{n}" for n in (1, 2, 3)]
    for n, d in enumerate(dirs, start=1):
        segment(d, f"site-p-{n}-tapped-000000.cap", node=n)
    segment(dirs[0], "site-p-1-forwarded-000000.cap", stream=Stream.FORWARDED, n=3)
    segment(dirs[0], "site-p-1-forwarded-000001.cap", stream=Stream.FORWARDED, n=4, cut=True)
    (dirs[1] / "notes.txt").write_text("not a segment")
    return dirs


def test_collect_places_segments_by_node_and_writes_the_manifest(
    sidecars: list[Path], tmp_path: Path
) -> None:
    out = tmp_path / "collected"
    result = collect(sidecars, out, now_us=T0)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.cap"))
    assert files == [
        "site-p/node-1/site-p-1-forwarded-000000.cap",
        "site-p/node-1/site-p-1-forwarded-000001.cap",
        "site-p/node-1/site-p-1-tapped-000000.cap",
        "site-p/node-2/site-p-2-tapped-000000.cap",
        "site-p/node-3/site-p-3-tapped-000000.cap",
    ]
    manifest = parse_manifest_untrusted((out / MANIFEST_NAME).read_text())
    assert manifest == result.manifest
    assert manifest.sources == tuple(map(str, sidecars))
    by_file = {s.file: s for s in manifest.segments}
    cut = by_file["site-p/node-1/site-p-1-forwarded-000001.cap"]
    assert (cut.node, cut.stream, cut.complete, cut.records) == (1, "forwarded", False, 3)
    assert cut.torn_bytes > 0 and cut.source == str(sidecars[0] / "site-p-1-forwarded-000001.cap")
    whole = by_file["site-p/node-2/site-p-2-tapped-000000.cap"]
    assert (whole.site, whole.node, whole.complete, whole.records) == ("site-p", 2, True, 5)
    assert (whole.first_time_us, whole.last_time_us) == (T0 + 1000, T0 + 5000)
    streams = {(c.node, c.stream): c for c in coverage(manifest)}
    assert streams[(1, "forwarded")].segments == 2 and streams[(1, "forwarded")].records == 6
    assert streams[(1, "forwarded")].cut == ["site-p/node-1/site-p-1-forwarded-000001.cap"]
    assert [k for k, c in streams.items() if c.cut] == [(1, "forwarded")]


def test_collect_again_takes_what_grew_and_keeps_the_rest(
    sidecars: list[Path], tmp_path: Path
) -> None:
    out = tmp_path / "collected"
    collect(sidecars, out, now_us=T0)
    # the open segment was closed since, with more records; node 2 started a new one
    segment(sidecars[0], "site-p-1-forwarded-000001.cap", stream=Stream.FORWARDED, n=6)
    segment(sidecars[1], "site-p-2-tapped-000001.cap", node=2)
    again = collect(sidecars, out, now_us=T0 + 1)
    assert sorted(again.copied) == [
        "site-p/node-1/site-p-1-forwarded-000001.cap",
        "site-p/node-2/site-p-2-tapped-000001.cap",
    ]
    assert len(again.unchanged) == 4
    manifest = parse_manifest_untrusted((out / MANIFEST_NAME).read_text())
    grown = {s.file: s for s in manifest.segments}["site-p/node-1/site-p-1-forwarded-000001.cap"]
    assert grown.complete and grown.records == 6
    assert len(manifest.segments) == 6 and manifest.collected_at_us == T0 + 1


def test_a_source_given_twice_or_an_older_copy_is_not_collected_twice(
    sidecars: list[Path], tmp_path: Path
) -> None:
    older = tmp_path / "older-copy-of-p1"
    segment(older, "site-p-1-forwarded-000001.cap", stream=Stream.FORWARDED, n=2, cut=True)
    live = sidecars[0] / "site-p-1-forwarded-000001.cap"
    for order in ([sidecars[0], sidecars[0], older], [older, sidecars[0]]):
        out = tmp_path / f"collected-{len(order)}"
        result = collect(order, out, now_us=T0)
        assert len(result.manifest.segments) == 3
        assert len(list(out.rglob("*.cap"))) == 3
        # the same segment copied at two moments: the longer copy is kept
        kept = out / "site-p/node-1/site-p-1-forwarded-000001.cap"
        assert kept.read_bytes() == live.read_bytes()
    assert result.duplicates == 0  # the older copy came first and was replaced


def test_a_corrupt_file_is_set_aside_and_listed(sidecars: list[Path], tmp_path: Path) -> None:
    bad = sidecars[2] / "site-p-3-tapped-000000.cap"
    data = bytearray(bad.read_bytes())
    data[40] ^= 0xFF
    bad.write_bytes(bytes(data))
    out = tmp_path / "collected"
    result = collect(sidecars, out, now_us=T0)
    (rejected,) = result.manifest.rejected
    assert rejected.source == str(bad) and "corrupt" in rejected.error
    assert (out / rejected.file).read_bytes() == bytes(data)
    assert rejected.file.startswith(".rejected/")  # a hidden folder: readers skip it
    assert all(s.node != 3 for s in result.manifest.segments)


def test_site_filter_and_clear_errors(sidecars: list[Path], tmp_path: Path) -> None:
    segment(sidecars[0], "site-d-1-ingested-000000.cap", site="site-d", stream=Stream.INGESTED)
    result = collect(sidecars, tmp_path / "d", now_us=T0, site="site-d")
    assert [s.site for s in result.manifest.segments] == ["site-d"]
    assert result.other_sites == 5
    with pytest.raises(CollectError, match=r"no capture segments.*site 'nowhere'"):
        collect(sidecars, tmp_path / "x", now_us=T0, site="nowhere")
    with pytest.raises(CollectError, match="inside the source"):
        collect(sidecars, sidecars[0] / "collected", now_us=T0)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / MANIFEST_NAME).write_text(json.dumps({"hello": 1}))
    with pytest.raises(CollectError, match="not a capture manifest"):
        collect(sidecars, tmp_path / "other", now_us=T0)


def test_command_line_prints_coverage_and_names_cut_segments(
    sidecars: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "collected"
    assert main(["capture", "collect", "--out", str(out), *map(str, sidecars)]) == 0
    printed = capsys.readouterr().out
    assert "5 segment(s)" in printed and "manifest.json" in printed
    assert "site-p node 1 forwarded: 2 segment(s), 1 cut, 6 records" in printed
    assert "site-p/node-1/site-p-1-forwarded-000001.cap:" in printed and "torn" in printed


def test_command_line_missing_source_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    assert main(["capture", "collect", "--out", str(tmp_path / "o"), str(missing)]) == 1
    err = capsys.readouterr().err
    assert "drgate capture:" in err and str(missing) in err and "capture.directory" in err
    assert "Traceback" not in err
