"""Acceptance: captures written by the sidecars of a real two-site run audit clean.

Two sites (three brokers and three sidecars each, embedded bus, WAN emulators)
with capture on, queues in all four modes, a few hundred messages published at
P and some consumed there; once D has converged the sites are stopped (so
every segment gets its trailer) and the audit, lag and traffic jobs run on
what the sidecars wrote.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lab.site import TwoSites, finish_client
from protocol.capture import CaptureReader, Stream
from protocol.modes import Mode
from tests.lab import status

pytestmark = [pytest.mark.spark, pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

MODES = {"q-full": "full", "q-enq": "enqueue", "q-wire": "wiring", "q-none": "none"}
PUBLISHED = 150  # per queue
CONSUMED = 40  # at P, from q-full (replicated dequeues) and q-enq (filtered accepts)
DEADLINE_S = 60.0


def wait_for(what: str, check: Callable[[], bool], *, timeout: float = DEADLINE_S) -> None:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting until {what}")
        time.sleep(0.1)  # polling other processes: there is no event to await


def queues(described: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {q["name"]: q for q in described["queues"]}


def converged(two: TwoSites) -> bool:
    p, d = queues(two.p.describe(2)), queues(two.d.describe(2))
    return (
        "q-full" in d
        and p["q-full"]["digest"] == d["q-full"]["digest"]
        and d.get("q-enq", {}).get("depth") == PUBLISHED
    )


def _seeded(egress: dict[str, Any]) -> bool:
    return bool(
        egress["link_state"] == "up"
        and egress["resync"]["total"]
        and not egress["resync"]["active"]
    )


def read_segments(directory: Path) -> list[tuple[Path, CaptureReader, list[Any]]]:
    found = []
    for path in sorted(directory.rglob("*.cap")):
        with path.open("rb") as fh:
            reader = CaptureReader(fh)
            records = list(reader)
        found.append((path, reader, records))
    return found


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("twosites")
    directory = work / "captures"
    with TwoSites(workdir=work / "sites", capture_dir=directory, metrics=True) as two:
        # D's seeding resync (of an empty P) is done: the declares below are
        # forwarded events, not part of a snapshot.
        wait_for("D is seeded", lambda: _seeded(status(two, "site-p", 1)))
        for queue, mode in MODES.items():
            done = two.p.admin(1, "add-queue", queue, "--replicate", mode)
            assert done.returncode == 0, done.stderr
        publishers = [
            two.p.client_popen(1, "publish", two.p.amqp[1], q, "--count", str(PUBLISHED))
            for q in MODES
        ]
        for publisher in publishers:
            assert finish_client(publisher)["accepted"] == PUBLISHED
        for q in ("q-full", "q-enq"):
            got = two.p.client(2, "consume", two.p.amqp[2], q, "--count", str(CONSUMED))
            assert got["received"] == CONSUMED
        wait_for("D converged (full digest equal, enqueue queue complete)", lambda: converged(two))
    return directory


def test_segments_are_complete_and_streams_as_configured(captures: Path) -> None:
    segments = read_segments(captures)
    assert segments, "no capture segment written"
    by_stream: Counter[tuple[str, Stream]] = Counter()
    tapped_none = Counter[str]()
    forwarded_queues: set[str] = set()
    wire = raw = 0
    applied_at: dict[int, set[tuple[int, int, bool]]] = {}  # D node -> what it recorded
    for path, reader, records in segments:
        assert reader.complete, f"{path.name} has no trailer after a clean stop"
        assert reader.header is not None
        site, stream = reader.header.site, reader.header.stream
        by_stream[(site, stream)] += len(records)
        if stream is Stream.INGESTED:
            applied = applied_at.setdefault(reader.header.node, set())
            applied.update((r.cseq, r.origin_cseq, r.resync) for r in records)
        for r in records:
            if stream is Stream.TAPPED and r.mode == Mode.NONE:
                tapped_none.update(r.queues)
            if stream is Stream.FORWARDED:
                forwarded_queues.update(r.queues)
                wire += r.wire_size
                raw += r.size
    # every P sidecar taps; D's sidecars tap nothing; only the egress forwards
    assert by_stream[("site-p", Stream.TAPPED)] > 3 * PUBLISHED * len(MODES)
    assert by_stream[("site-p", Stream.FORWARDED)] > 0
    assert by_stream[("site-d", Stream.INGESTED)] > 0
    assert by_stream[("site-d", Stream.TAPPED)] == 0
    assert by_stream[("site-p", Stream.INGESTED)] == 0
    # every D sidecar records what its node applied, the same applications at
    # the same D cseqs, the seeding resync's installation among them
    assert sorted(applied_at) == [1, 2, 3]
    assert applied_at[1] == applied_at[2] == applied_at[3]
    assert any(resync for _, _, resync in applied_at[1])
    # the none queue's publishes are in the tapped stream as filtered, never forwarded
    assert tapped_none["q-none"] >= 3 * PUBLISHED
    assert "q-none" not in forwarded_queues
    assert {"q-full", "q-enq", "q-wire"} <= forwarded_queues
    assert 0 < wire <= raw  # each event's share of the (compressed) batches


def test_real_run_audits_clean(spark: Any, captures: Path, tmp_path: Path) -> None:
    import pandas as pd

    from analysis import jobs

    code = jobs.run_job(spark, "audit", captures, tmp_path)
    tables = tmp_path / "audit" / "tables"
    violations = pd.read_parquet(tables / "violations.parquet")
    assert violations.empty, violations.head(20).to_string()
    assert code == 0
    per_queue = pd.read_parquet(tables / "per_queue.parquet").set_index("queue")
    # publishes on q-full and q-enq, the dequeues of q-full, declares: all
    # applied once.  The broker turns the accepts that arrive together into
    # one command, so the 40 dequeues are between 1 and 40 events.
    dequeues = per_queue.loc["q-full", "forwarded"] - PUBLISHED - 1
    assert 1 <= dequeues <= CONSUMED
    assert per_queue.loc["q-enq", "forwarded"] == PUBLISHED + 1
    assert (per_queue["forwarded"] == per_queue["applied"]).all()
    assert "q-none" not in per_queue.index


@pytest.mark.parametrize("job", ["lag", "traffic"])
def test_lag_and_traffic_reports(spark: Any, captures: Path, tmp_path: Path, job: str) -> None:
    from analysis import jobs

    assert jobs.run_job(spark, job, captures, tmp_path) == 0
    target = tmp_path / job
    page = (target / "report.html").read_text(encoding="utf-8")
    pngs = sorted((target / "plots").glob("*.png"))
    assert pngs, "no plot written"
    assert page.count("data:image/png;base64,") >= len(pngs)
    tables = sorted((target / "tables").glob("*.parquet"))
    assert tables and all(t.with_suffix(".csv").is_file() for t in tables)
    if job == "lag":
        import pandas as pd

        summary = pd.read_parquet(target / "tables" / "summary.parquet")
        overall = summary[summary["queue"].isna()].iloc[0]
        assert overall["events"] >= 2 * PUBLISHED
        assert 0 <= overall["p50_ms"] <= overall["max_ms"] < DEADLINE_S * 1000


@pytest.mark.long  # make test-long
def test_collected_run_reports_every_sidecar_in_its_coverage(
    spark: Any, captures: Path, tmp_path: Path
) -> None:
    import pandas as pd

    from analysis import jobs
    from gateway.cli import main
    from protocol.capturemanifest import MANIFEST_NAME, parse_manifest_untrusted

    out = tmp_path / "collected"
    sources = [str(d) for d in sorted(captures.iterdir()) if d.is_dir()]
    assert main(["capture", "collect", "--out", str(out), *sources]) == 0
    manifest = parse_manifest_untrusted((out / MANIFEST_NAME).read_text())
    assert manifest.segments and all(s.complete for s in manifest.segments)
    tapping = {s.node for s in manifest.segments if s.site == "site-p" and s.stream == "tapped"}
    assert tapping == {1, 2, 3}
    assert jobs.run_job(spark, "audit", out, tmp_path) == 0
    coverage = pd.read_parquet(tmp_path / "audit" / "tables" / "coverage.parquet")
    assert set(coverage["stream"]) == {"tapped", "forwarded", "ingested"}
    assert coverage["cut_segments"].sum() == 0 and coverage["missing_segments"].sum() == 0
    assert coverage["records"].sum() == sum(s.records for s in manifest.segments)
