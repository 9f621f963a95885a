"""analysis.jobs and analysis.report on captures of a simulated two-site run."""

from __future__ import annotations

import base64
import re
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from analysis import jobs
from protocol.cluster import Kind
from tests.analysis import twosite
from tests.analysis.twosite import INC_P, Applied

pytestmark = pytest.mark.spark


def violations(spark: Any, directory: Path) -> list[tuple[str, int, int, str | None]]:
    df = spark.read.format("drgate-capture").load(str(directory))
    rows = jobs.audit(df)["violations"].collect()
    return [(r.violation, r.origin_incarnation, r.cseq, r.queue) for r in rows]


def pandas(frame: Any) -> pd.DataFrame:
    result: pd.DataFrame = frame.toPandas()
    return result


def signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


P = signed(INC_P)


@pytest.fixture(scope="module")
def clean_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("clean")
    twosite.write(twosite.plan(), directory)
    return directory


def test_clean_two_site_run_audits_clean(spark: Any, clean_dir: Path) -> None:
    assert violations(spark, clean_dir) == []


def _dropped(run: twosite.Run) -> tuple[str, int, str]:
    victim = twosite.event(run, Kind.PUBLISH, "orders", 2)
    run.applied = [a for a in run.applied if a.event is not victim]
    return "missing_at_d", victim.cseq, "orders"


def _duplicate(run: twosite.Run) -> tuple[str, int, str]:
    victim = twosite.event(run, Kind.PUBLISH, "billing", 1)
    run.applied.append(Applied(victim, lag_us=900_000))  # a replay applied again later
    return "applied_twice", victim.cseq, "billing"


def _reordered(run: twosite.Run) -> tuple[str, int, str]:
    first = twosite.event(run, Kind.PUBLISH, "orders", 1)
    second = twosite.event(run, Kind.PUBLISH, "orders", 2)
    i = next(n for n, a in enumerate(run.applied) if a.event is first)
    j = next(n for n, a in enumerate(run.applied) if a.event is second)
    run.applied[i], run.applied[j] = run.applied[j], run.applied[i]
    return "out_of_order", first.cseq, "orders"  # the earlier event arrived late


def _leaked(run: twosite.Run) -> tuple[str, int, str]:
    victim = twosite.event(run, Kind.PUBLISH, "scratch", 1)  # mode none: must be filtered
    run.forwarded.append(victim)
    run.forwarded.sort(key=lambda r: r.cseq)
    run.applied.append(Applied(victim, lag_us=30_000))
    return "filtered_leaked", victim.cseq, "scratch"


def _leaked_message_in_wiring_mode(run: twosite.Run) -> tuple[str, int, str]:
    victim = twosite.event(run, Kind.PUBLISH, "config", 0)  # wiring: no messages
    run.forwarded.append(victim)
    run.forwarded.sort(key=lambda r: r.cseq)
    run.applied.append(Applied(victim, lag_us=30_000))
    return "filtered_leaked", victim.cseq, "config"


@pytest.mark.parametrize(
    "inject",
    [_dropped, _duplicate, _reordered, _leaked, _leaked_message_in_wiring_mode],
    ids=["dropped", "duplicate", "reordered", "leaked-none", "leaked-wiring"],
)
def test_injected_fault_reported_with_exact_cseq_and_queue(
    spark: Any, tmp_path: Path, inject: Any
) -> None:
    run = twosite.plan()
    violation, cseq, queue = inject(run)
    twosite.write(run, tmp_path)
    assert violations(spark, tmp_path) == [(violation, P, cseq, queue)]


def test_lag_job_measures_forward_to_apply(spark: Any, clean_dir: Path) -> None:
    df = spark.read.format("drgate-capture").load(str(clean_dir))
    tables = jobs.lag(df, window_s=10)
    summary = pandas(tables["summary"])
    overall = summary[summary["queue"].isna()].iloc[0]
    run = twosite.plan()
    lags = sorted(a.lag_us / 1000 for a in run.applied for _ in a.event.queues)
    assert overall["events"] == len(lags)
    assert overall["max_ms"] == pytest.approx(max(lags))
    assert min(lags) <= overall["p50_ms"] <= max(lags)
    assert set(summary["queue"].dropna()) == {"orders", "billing", "config"}
    windows = pandas(tables["overall"])
    assert windows["events"].sum() == len(lags)
    assert len(windows) > 1  # the run spans several 10 s windows


def test_traffic_job_counts_and_compression(spark: Any, clean_dir: Path) -> None:
    df = spark.read.format("drgate-capture").load(str(clean_dir))
    tables = jobs.traffic(df, window_s=10)
    run = twosite.plan()
    totals = pandas(tables["totals"]).set_index("stream")
    assert totals.loc["tapped", "events"] == len(run.tapped)
    assert totals.loc["forwarded", "events"] == len(run.forwarded)
    raw = sum(r.size for r in run.forwarded)
    wire = sum(r.wire_size for r in run.forwarded)
    assert totals.loc["forwarded", "compression_ratio"] == pytest.approx(raw / wire)
    by_mode = pandas(tables["by_mode"])
    tapped_none = by_mode[(by_mode["stream"] == "tapped") & (by_mode["mode"] == "none")]
    assert tapped_none["events"].sum() == sum(1 for r in run.tapped if r.mode == 0)
    by_queue = pandas(tables["by_queue"])
    fwd_orders = by_queue[(by_queue["stream"] == "forwarded") & (by_queue["queue"] == "orders")]
    assert fwd_orders["events"].sum() == sum(1 for r in run.forwarded if "orders" in r.queues)


# --- reports -----------------------------------------------------------------------


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: dict[str, bytes] = {}
        self.rows: dict[str, int] = {}
        self._table: str | None = None
        self._in_body = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            src = a.get("src") or ""
            match = re.fullmatch(r"data:image/png;base64,(.+)", src)
            assert match, f"plot {a.get('alt')} is not embedded"
            self.images[a["alt"] or ""] = base64.b64decode(match.group(1))
        elif tag == "table":
            self._table = (a.get("id") or "").removeprefix("table-")
            self.rows[self._table] = 0
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body and self._table is not None:
            self.rows[self._table] += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._in_body = False
        elif tag == "table":
            self._table = None


def _page(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


EXPECTED_PLOTS = {
    "audit": {"violations", "per_queue"},
    "lag": {"lag_overall", "lag_per_queue"},
    "traffic": {"events_per_queue", "bytes_per_mode", "events_per_rule", "compression"},
}


@pytest.mark.parametrize("job", ["lag", "traffic"])
def test_report_embeds_every_plot_and_table(
    spark: Any, clean_dir: Path, tmp_path: Path, job: str
) -> None:
    assert jobs.run_job(spark, job, clean_dir, tmp_path, window_s=10) == 0
    target = tmp_path / job
    page = _page(target / "report.html")
    assert set(page.images) == EXPECTED_PLOTS[job]
    for name, png in page.images.items():
        assert png.startswith(b"\x89PNG\r\n\x1a\n"), name
        assert (target / "plots" / f"{name}.png").read_bytes() == png
    for name, rows in page.rows.items():
        table = pd.read_parquet(target / "tables" / f"{name}.parquet")
        assert rows == len(table), name
        assert len(pd.read_csv(target / "tables" / f"{name}.csv")) == rows
    assert page.rows["segments"] == 4  # tapped, two forwarded, ingested
    if job == "lag":
        assert page.rows["summary"] == 4  # overall + orders, billing, config
    else:
        assert page.rows["totals"] == 3  # tapped, forwarded, ingested


def test_audit_report_lists_violations_and_exits_1(spark: Any, tmp_path: Path) -> None:
    run = twosite.plan()
    _, dropped, _ = _dropped(run)
    _, twice, _ = _duplicate(run)
    twosite.write(run, tmp_path / "captures")
    assert jobs.run_job(spark, "audit", tmp_path / "captures", tmp_path / "out") == 1
    report = tmp_path / "out" / "audit" / "report.html"
    page = _page(report)
    assert set(page.images) == EXPECTED_PLOTS["audit"]
    assert page.rows["violations"] == 2
    assert page.rows["per_queue"] == 3  # orders, billing, config (scratch is never forwarded)
    table = pd.read_csv(tmp_path / "out" / "audit" / "tables" / "violations.csv")
    assert sorted(zip(table["violation"], table["cseq"], strict=True)) == [
        ("applied_twice", twice),
        ("missing_at_d", dropped),
    ]
    assert "2 violation(s) found" in report.read_text(encoding="utf-8")


def test_cut_segment_reported_as_cut(spark: Any, tmp_path: Path) -> None:
    run = twosite.plan()
    twosite.write(run, tmp_path / "captures", cut_last=True)
    df = spark.read.format("drgate-capture").load(str(tmp_path / "captures"))
    segs = {r.segment.rsplit("/", 1)[1]: r for r in jobs.segments(df).collect()}
    cut = segs["d1-ingested-0000.cap"]
    assert cut.complete is False
    assert cut.records == len(run.applied) - 1  # every whole record, the torn one lost
    assert all(r.complete for name, r in segs.items() if name != "d1-ingested-0000.cap")
    # The torn record was the last application D's capture holds: the audit
    # cannot tell whether D applied it, and says so instead of calling it lost.
    last = max(run.applied, key=lambda a: a.event.cseq).event
    assert violations(spark, tmp_path / "captures") == []
    assert not_captured(spark, tmp_path / "captures") == {last.cseq}
    assert jobs.run_job(spark, "audit", tmp_path / "captures", tmp_path / "out") == 0
    html = (tmp_path / "out" / "audit" / "report.html").read_text(encoding="utf-8")
    assert "Cut segments" in html and "d1-ingested-0000.cap" in html
    assert "not captured, so not judged" in html


def not_captured(spark: Any, directory: Path) -> set[int]:
    df = spark.read.format("drgate-capture").load(str(directory))
    return {r.cseq for r in jobs.audit(df)["not_captured"].collect()}


def test_events_after_ds_captures_end_are_not_captured_but_a_gap_before_is_missing(
    spark: Any, tmp_path: Path
) -> None:
    # Issue 19: the audit reported missing_at_d for events whose capture had
    # simply ended earlier on that node.
    run = twosite.plan()
    run.applied.sort(key=lambda a: a.event.cseq)
    after_the_end = run.applied[-3:]
    run.applied = run.applied[:-3]  # D's capture stopped before these
    _, dropped, queue = _dropped(run)  # and one in the middle never applied
    twosite.write(run, tmp_path)
    assert violations(spark, tmp_path) == [("missing_at_d", P, dropped, queue)]
    assert not_captured(spark, tmp_path) == {a.event.cseq for a in after_the_end}


def not_captured_details(spark: Any, directory: Path) -> dict[int, str]:
    df = spark.read.format("drgate-capture").load(str(directory))
    return {r.cseq: r.detail for r in jobs.audit(df)["not_captured"].collect()}


def test_every_d_node_recording_an_application_is_not_applied_twice(
    spark: Any, tmp_path: Path
) -> None:
    # Every D sidecar records what its node applied: three records of one
    # application (one D cseq) are one application.
    run = twosite.plan()
    twosite.write(run, tmp_path, d_nodes={1: slice(None), 2: slice(None), 3: slice(None)})
    assert violations(spark, tmp_path) == []


def test_one_event_in_several_records_at_one_cseq_is_applied_once(
    spark: Any, tmp_path: Path
) -> None:
    # The chaos run's first audit: an event whose commands for q-switch were of
    # three kinds gave three records at D cseq 1412, "applied 3 times".
    run = twosite.plan()
    victim = twosite.event(run, Kind.PUBLISH, "orders", 1)
    at = next(n for n, a in enumerate(run.applied) if a.event is victim)
    again = Applied(replace(victim, kind=int(Kind.ENQUEUE)), lag_us=20_000, same_cseq=True)
    run.applied.insert(at + 1, again)
    twosite.write(run, tmp_path)
    assert violations(spark, tmp_path) == []


def test_a_killed_ingress_leaves_events_not_captured_that_another_node_judges(
    spark: Any, tmp_path: Path
) -> None:
    run = twosite.plan()
    run.applied.sort(key=lambda a: a.event.cseq)
    unseen = {a.event.cseq for a in run.applied[20:25]}
    # node 1 (the ingress) died with records 20..24 unwritten; node 2 started
    # after them: nobody recorded them, so they are not judged
    twosite.write(run, tmp_path / "a", d_nodes={1: slice(0, 20), 2: slice(25, None)})
    assert violations(spark, tmp_path / "a") == []
    assert set(not_captured_details(spark, tmp_path / "a")) == unseen
    # a standby that recorded through them judges them: one never applied is missing
    _, dropped, queue = _dropped(run)
    twosite.write(run, tmp_path / "b", d_nodes={1: slice(0, 20), 3: slice(None)})
    assert violations(spark, tmp_path / "b") == [("missing_at_d", P, dropped, queue)]


def test_an_event_in_a_resync_snapshot_is_not_missing(spark: Any, tmp_path: Path) -> None:
    run = twosite.plan()
    _, dropped, queue = _dropped(run)
    run.resync_cuts = [dropped - 1]  # a resync cut before it does not cover it
    twosite.write(run, tmp_path / "before")
    assert violations(spark, tmp_path / "before") == [("missing_at_d", P, dropped, queue)]
    run.resync_cuts = [dropped + 5]
    twosite.write(run, tmp_path / "after")
    assert violations(spark, tmp_path / "after") == []
    detail = not_captured_details(spark, tmp_path / "after")[dropped]
    assert f"resync D installed, cut at origin cseq {dropped + 5}" in detail
