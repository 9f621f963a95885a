"""Analysis jobs over capture DataFrames: audit, lag, traffic.

Each job is a pure ``DataFrame -> DataFrames`` function (:func:`audit`,
:func:`lag`, :func:`traffic`); :func:`run_job` evaluates one against a
session and writes its tables (Parquet and CSV), PNG plots and one HTML
report; :func:`main` is the thin command line that builds the session.  Run
it as ``drgate analyze JOB --captures DIR``, ``python -m analysis.jobs JOB
--captures DIR`` or ``spark-submit analysis/jobs.py JOB --captures DIR``.

Event identity across the sites is (origin incarnation, origin cseq, queue):
on P's forwarded stream the event is the capturing site's own
(``incarnation``, ``cseq``) unless the record names an origin; on D's
ingested stream it is the record's (``origin_incarnation``, ``origin_cseq``).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from analysis.source import CaptureSourceError, filesystem, list_segments, register
from protocol.capturemanifest import (
    MANIFEST_NAME,
    Manifest,
    coverage,
    parse_manifest_untrusted,
)
from protocol.errors import RemoteProtocolError

JOBS = ("audit", "lag", "traffic")
DEFAULT_WINDOW_S = 10  # ten seconds: fine enough to see a stall, coarse enough to be stable
DEFAULT_MASTER = "local[2]"
PROGRESS_PREFIX = "drgate-progress: "  # stderr lines a launcher (drgate analyze) shows as progress

# What each mode replicates (docs/architecture.md, section 1), judged on message kinds
# only: a message kind forwarded for a mode that does not carry it leaked
# through the filter.  Other kinds (declares, deletes, bindings...) are not
# judged, except that mode none forwards nothing at all.
MESSAGE_KINDS = (
    "publish",
    "enqueue",
    "acquire",
    "acquire_matching",
    "accept",
    "release",
    "dequeue",
    "purge",
)
DEQUEUE_KINDS = ("acquire", "acquire_matching", "accept", "release", "dequeue", "purge")

KEY = ("event_incarnation", "event_cseq", "queue")


@dataclass
class JobResult:
    """What a job produced: named tables, and the exit code it asks for."""

    name: str
    tables: dict[str, DataFrame]
    exit_code: int = 0
    notes: list[str] = field(default_factory=list)


# --- shared views -----------------------------------------------------------


def segments(df: DataFrame) -> DataFrame:
    """One row per segment file: who wrote it, how many records, complete or cut."""
    return (
        df.where(F.col("queue_index") == 0)
        .groupBy("segment", "site", "node", "role", "stream", "complete")
        .agg(
            F.count("*").alias("records"),
            F.min("wall_time").alias("first_time"),
            F.max("wall_time").alias("last_time"),
        )
        .orderBy("segment")
    )


def forwarded(df: DataFrame) -> DataFrame:
    """P's forwarded stream, one row per (event, queue), first forward kept.

    Several egress sidecars may forward the same event (a takeover replays the
    spool): that is not a duplicate at D, so forwarded rows are deduplicated.
    """
    f = df.where(F.col("stream") == "forwarded")
    f = f.withColumn(
        "event_incarnation",
        F.when(F.col("origin_cseq") != 0, F.col("origin_incarnation")).otherwise(
            F.col("incarnation")
        ),
    ).withColumn(
        "event_cseq",
        F.when(F.col("origin_cseq") != 0, F.col("origin_cseq")).otherwise(F.col("cseq")),
    )
    return f.groupBy(*KEY).agg(
        F.min("wall_time_us").alias("forward_us"),
        F.min("mode").alias("mode"),
        F.min("kind_name").alias("kind_name"),
        F.min("rule").alias("rule"),
        F.min("site").alias("origin_site"),
    )


def _ingested_rows(df: DataFrame) -> DataFrame:
    return (
        df.where(F.col("stream") == "ingested")
        .withColumnRenamed("origin_incarnation", "event_incarnation")
        .withColumnRenamed("origin_cseq", "event_cseq")
        .withColumnRenamed("site", "dr_site")
        .withColumnRenamed("cseq", "apply_cseq")
    )


def ingested(df: DataFrame) -> DataFrame:
    """D's ingested stream, one row per (event, queue) application.

    Every D sidecar records what its node applied, and one event may give
    several records for a queue (one per kind of command): an application is
    one D cseq of one site, however many records name it.  A resync's
    installation is not an event (:func:`resync_cuts`).
    """
    return (
        _ingested_rows(df)
        .where(~F.coalesce(F.col("resync"), F.lit(False)))
        .groupBy(*KEY, "dr_site", "apply_cseq")
        .agg(F.min("wall_time_us").alias("apply_us"))
    )


def resync_cuts(df: DataFrame) -> DataFrame:
    """Per origin incarnation, the highest cut of a resync D installed."""
    return (
        _ingested_rows(df)
        .where(F.col("resync"))
        .groupBy("event_incarnation")
        .agg(F.max("event_cseq").alias("resync_cut"))
    )


def ingested_spans(df: DataFrame) -> DataFrame:
    """Per ingested segment and origin incarnation, the first and last origin
    cseq it recorded.  A segment holds, in order, every application its node
    made from its first record to its last (a sidecar killed loses only its
    segment's tail), and D applies an origin's events in rising cseq: an
    event between a segment's first and last that the segment lacks was not
    applied."""
    return (
        _ingested_rows(df)
        .groupBy("segment", "event_incarnation")
        .agg(F.min("event_cseq").alias("span_first"), F.max("event_cseq").alias("span_last"))
    )


def _key_join(left: DataFrame, right: DataFrame, how: str) -> DataFrame:
    # Null-safe on the queue: a command that names no queue (an exchange
    # declare) is still an event to match.
    cond = [left[k].eqNullSafe(right[k]) for k in KEY]
    joined = left.alias("l").join(right.alias("r"), cond, how)
    if how in ("left_anti", "left_semi"):
        return joined
    return joined.select("l.*", *[F.col(f"r.{c}") for c in right.columns if c not in KEY])


def leaked(mode: Column, kind_name: Column) -> Column:
    """True for an event the rules say should have been filtered."""
    return (
        (mode == "none")
        | ((mode == "wiring") & kind_name.isin(*MESSAGE_KINDS))
        | ((mode == "enqueue") & kind_name.isin(*DEQUEUE_KINDS))
    )


def _window_start(us: Column, window_s: int) -> Column:
    width = window_s * 1_000_000
    return F.timestamp_micros(F.floor(us / width) * width).alias("window_start")


# --- audit --------------------------------------------------------------------

VIOLATION_COLUMNS = ("violation", "origin_incarnation", "cseq", "queue", "kind_name", "detail")
VIOLATION_KINDS = ("missing_at_d", "applied_twice", "out_of_order", "filtered_leaked")


def audit(df: DataFrame) -> dict[str, DataFrame]:
    """Exactly-once and order audit of P's forwarded stream against D's ingested one.

    Returns ``violations`` (one row per violation: ``missing_at_d``,
    ``applied_twice``, ``out_of_order``, ``filtered_leaked``; ``cseq`` is the
    event's origin cseq), ``not_captured`` (forwarded events D's captures
    lack where no D capture spans them, or that a resync's snapshot covers:
    not violations, and the detail says which) and ``per_queue`` (events
    forwarded and applied per queue).
    """
    fwd = forwarded(df).withColumn("leaked", leaked(F.col("mode"), F.col("kind_name")))
    ing = ingested(df)

    def shape(frame: DataFrame, violation: str, detail: Column) -> DataFrame:
        return frame.select(
            F.lit(violation).alias("violation"),
            F.col("event_incarnation").alias("origin_incarnation"),
            F.col("event_cseq").alias("cseq"),
            F.col("queue"),
            F.col("kind_name"),
            detail.alias("detail"),
        )

    # An event D's captures lack is judged only where a segment spans it (see
    # ingested_spans): elsewhere no capture was running on any node, or every
    # one that was lost its tail (not_captured).  An event at or below the cut
    # of a resync D installed is in that snapshot, applied or not.
    absent = _key_join(fwd.where(~F.col("leaked")), ing, "left_anti").join(
        resync_cuts(df), "event_incarnation", "left"
    )
    spans = ingested_spans(df)
    spanned = absent.alias("a").join(
        spans.alias("s"),
        (F.col("a.event_incarnation") == F.col("s.event_incarnation"))
        & F.col("a.event_cseq").between(F.col("s.span_first"), F.col("s.span_last")),
        "left_semi",
    )
    in_resync = F.col("resync_cut").isNotNull() & (F.col("event_cseq") <= F.col("resync_cut"))
    judged = spanned.where(~in_resync)
    missing = shape(judged, "missing_at_d", F.concat(F.lit("forwarded in mode "), F.col("mode")))
    unjudged = _key_join(absent, judged.select(*KEY), "left_anti")
    not_captured = shape(
        unjudged,
        "not_captured",
        F.when(
            in_resync,
            F.concat(
                F.lit("in the snapshot of the resync D installed, cut at origin cseq "),
                F.col("resync_cut").cast("string"),
            ),
        ).otherwise(
            F.lit(
                "no D capture spans it (none was running, or each lost its tail with its sidecar)"
            )
        ),
    ).orderBy("origin_incarnation", "cseq", "queue")

    leaks = shape(
        fwd.where(F.col("leaked")),
        "filtered_leaked",
        F.concat(
            F.lit("forwarded in mode "),
            F.col("mode"),
            F.lit(" by rule "),
            F.coalesce(F.col("rule"), F.lit("(default)")),
        ),
    )

    copies = ing.groupBy(*KEY).agg(
        F.count("*").alias("copies"), F.sort_array(F.collect_list("apply_cseq")).alias("at")
    )  # one row per application (ingested): two rows are two applications
    kinds = fwd.select(*KEY, "kind_name")
    twice = _key_join(copies.where(F.col("copies") > 1), kinds, "left")
    twice = shape(
        twice,
        "applied_twice",
        F.concat(
            F.lit("applied "),
            F.col("copies").cast("string"),
            F.lit(" times at D cseq "),
            F.array_join(F.col("at").cast("array<string>"), ", "),
        ),
    )

    # Order: over first applications only (a duplicate is reported above), the
    # origin cseq must rise with D's apply order within each (origin, queue).
    first = ing.groupBy(*KEY).agg(F.min("apply_cseq").alias("apply_cseq"))
    w = (
        Window.partitionBy("event_incarnation", "queue")
        .orderBy("apply_cseq")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    ordered = first.withColumn("before", F.max("event_cseq").over(w))
    late = _key_join(ordered.where(F.col("event_cseq") < F.col("before")), kinds, "left")
    late = shape(
        late,
        "out_of_order",
        F.concat(
            F.lit("applied at D cseq "),
            F.col("apply_cseq").cast("string"),
            F.lit(" after origin cseq "),
            F.col("before").cast("string"),
        ),
    )

    violations = (
        missing.unionByName(leaks)
        .unionByName(twice)
        .unionByName(late)
        .orderBy("origin_incarnation", "cseq", "queue", "violation")
    )
    per_queue = (
        fwd.groupBy("queue")
        .agg(F.count("*").alias("forwarded"))
        .join(
            ing.groupBy("queue").agg(F.count("*").alias("applied")),
            "queue",
            "full_outer",
        )
        .na.fill(0, ["forwarded", "applied"])
        .orderBy("queue")
    )
    return {"violations": violations, "not_captured": not_captured, "per_queue": per_queue}


# --- lag ----------------------------------------------------------------------

PERCENTILES = (0.5, 0.9, 0.99)


def _lag_stats(frame: DataFrame, *group: Any) -> DataFrame:
    q = F.percentile_approx("lag_ms", list(PERCENTILES), 10000)
    return (
        frame.groupBy(*group)
        .agg(F.count("*").alias("events"), q.alias("q"), F.max("lag_ms").alias("max_ms"))
        .select(
            *group,
            "events",
            F.col("q")[0].alias("p50_ms"),
            F.col("q")[1].alias("p90_ms"),
            F.col("q")[2].alias("p99_ms"),
            "max_ms",
        )
    )


def lag(df: DataFrame, window_s: int = DEFAULT_WINDOW_S) -> dict[str, DataFrame]:
    """Lag from P's forward time to D's first apply time, in milliseconds.

    Returns ``overall`` (per window of ``window_s`` seconds of forward time),
    ``per_queue`` (per window and queue) and ``summary`` (the whole capture,
    overall and per queue: ``queue`` null is the overall row).
    """
    first = ingested(df).groupBy(*KEY).agg(F.min("apply_us").alias("apply_us"))
    joined = _key_join(forwarded(df), first, "inner").select(
        "queue",
        _window_start(F.col("forward_us"), window_s),
        ((F.col("apply_us") - F.col("forward_us")) / 1000.0).alias("lag_ms"),
    )
    overall = _lag_stats(joined, "window_start").orderBy("window_start")
    per_queue = _lag_stats(joined, "window_start", "queue").orderBy("window_start", "queue")
    summary = (
        _lag_stats(joined.withColumn("queue", F.lit(None).cast("string")), "queue")
        .unionByName(_lag_stats(joined, "queue"))
        .orderBy(F.col("queue").asc_nulls_first())
    )
    return {"overall": overall, "per_queue": per_queue, "summary": summary}


# --- traffic ------------------------------------------------------------------


def traffic(df: DataFrame, window_s: int = DEFAULT_WINDOW_S) -> dict[str, DataFrame]:
    """Events and bytes per queue, mode and rule over time, and link compression.

    Queue tables count (event, queue) rows: a publish routed to two queues
    counts once for each, with its full size.  Mode and rule tables count
    events.  ``compression``: on the forwarded stream, ``raw_bytes`` (sum of
    encoded event sizes) over ``wire_bytes`` (sum of the events' shares of the
    compressed link batches), for records that carry a wire size.
    """
    rows = df.withColumn("window_start", _window_start(F.col("wall_time_us"), window_s))
    events = rows.where(F.col("queue_index") == 0)

    def counted(frame: DataFrame, *group: Any) -> DataFrame:
        return (
            frame.groupBy("window_start", "stream", *group)
            .agg(F.count("*").alias("events"), F.sum("bytes").alias("bytes"))
            .orderBy("window_start", "stream", *group)
        )

    by_rule = events.withColumn("rule", F.coalesce(F.col("rule"), F.lit("(default)")))
    wired = events.where((F.col("stream") == "forwarded") & (F.col("wire_bytes") > 0))
    compression = (
        wired.groupBy("window_start")
        .agg(F.sum("bytes").alias("raw_bytes"), F.sum("wire_bytes").alias("wire_bytes"))
        .withColumn("ratio", F.col("raw_bytes") / F.col("wire_bytes"))
        .orderBy("window_start")
    )
    totals = (
        events.groupBy("stream")
        .agg(
            F.count("*").alias("events"),
            F.sum("bytes").alias("bytes"),
            F.sum(F.when(F.col("wire_bytes") > 0, F.col("bytes"))).alias("raw_bytes_wired"),
            F.sum("wire_bytes").alias("wire_bytes"),
        )
        .withColumn("compression_ratio", F.col("raw_bytes_wired") / F.col("wire_bytes"))
        .orderBy("stream")
    )
    return {
        "totals": totals,
        "by_queue": counted(rows, "queue"),
        "by_mode": counted(events, "mode"),
        "by_rule": counted(by_rule, "rule"),
        "compression": compression,
    }


# --- coverage (a collected directory's manifest) -----------------------------------


def load_manifest(captures: str | os.PathLike[str]) -> Manifest | None:
    """The manifest ``drgate capture collect`` wrote at the root of ``captures``, if any."""
    import pyarrow.fs as pafs

    fs, root = filesystem(os.fspath(captures))
    path = root.rstrip("/") + "/" + MANIFEST_NAME
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as fh:
        text = fh.read()
    try:
        return parse_manifest_untrusted(text)
    except RemoteProtocolError as exc:
        raise CaptureSourceError(
            f"{path}: {exc}; remove it or collect again (drgate capture collect)"
        ) from None


COVERAGE_COLUMNS = (
    "site",
    "node",
    "stream",
    "segments",
    "cut_segments",
    "records",
    "first_time",
    "last_time",
    "missing_segments",
    "cut_files",
)


def coverage_table(manifest: Manifest, read: Sequence[str]) -> Any:
    """Per (site, node, stream) of the manifest: segments, cut ones, records, time span.

    ``missing_segments`` counts the manifest's segments not among ``read`` (the
    ``segment`` names the job read): deleted since the collection.
    """
    import pandas as pd

    def present(file: str) -> bool:
        return any(name == file or name.endswith("/" + file) for name in read)

    missing = {s.file for s in manifest.segments if not present(s.file)}
    rows = []
    for c in coverage(manifest):
        files = [
            s.file
            for s in manifest.segments
            if (s.site, s.node, s.stream) == (c.site, c.node, c.stream)
        ]
        rows.append(
            (
                c.site,
                c.node,
                c.stream,
                c.segments,
                len(c.cut),
                c.records,
                pd.to_datetime(c.first_time_us, unit="us", utc=True) if c.records else pd.NaT,
                pd.to_datetime(c.last_time_us, unit="us", utc=True) if c.records else pd.NaT,
                sum(1 for f in files if f in missing),
                ", ".join(c.cut),
            )
        )
    return pd.DataFrame(rows, columns=list(COVERAGE_COLUMNS))


# --- running a job --------------------------------------------------------------


def check_captures(captures: str | os.PathLike[str]) -> list[str]:
    """The segment files under ``captures``; a clear error when there are none."""
    found = list_segments(captures)
    if not found:
        raise CaptureSourceError(
            f"no capture segments under {str(captures)!r}; is capture enabled in the "
            "sidecar config (capture.directory) and is this that directory?"
        )
    return found


def check_master(master: str, timeout_s: float = 5.0) -> None:
    """Raise :class:`CaptureSourceError` unless a ``spark://`` master accepts a connection.

    Spark itself retries an absent master for about a minute and then says
    only that "all masters are unresponsive".  Other masters are not checked.
    """
    import socket

    if not master.startswith("spark://"):
        return
    problems = []
    for address in master.removeprefix("spark://").split(","):  # several: HA masters
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise CaptureSourceError(
                f"--master {master!r}: a standalone master is spark://HOST:PORT"
            )
        try:
            with socket.create_connection((host, int(port)), timeout_s):
                return
        except OSError as exc:
            problems.append(f"{address}: {exc.strerror or exc}")
    raise CaptureSourceError(
        f"cannot reach the Spark master {master} ({'; '.join(problems)}); start it, or check "
        "the URL its log prints ('Starting Spark master at spark://...'), or run on this "
        "machine with --master local[2]"
    )


def build_session(
    master: str = DEFAULT_MASTER,
    app: str = "drgate-analyze",
    conf: Sequence[tuple[str, str]] = (),
) -> SparkSession:
    """A session for the jobs; the data source registered, timestamps in UTC.

    ``conf``: further Spark settings (``--conf KEY=VALUE``), applied last.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.appName(app)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")  # rich draws the progress
    )
    for key, value in conf:
        builder = builder.config(key, value)
    if master:
        builder = builder.master(master)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def run_job(
    spark: SparkSession,
    job: str,
    captures: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    window_s: int = DEFAULT_WINDOW_S,
    step: Callable[[str], None] = lambda _: None,
) -> int:
    """Run ``job`` over the captures, write tables, plots and the report; the exit code.

    ``step`` is told what is being done (for a progress display).
    """
    from analysis import report

    if job not in JOBS:
        raise CaptureSourceError(f"unknown job {job!r}; jobs: {', '.join(JOBS)}")
    check_captures(captures)
    step("reading captures")
    # Every table is a Spark job of its own: read the segments once, keep the
    # rows in memory (spilled to the executors' disks when they do not fit).
    df = spark.read.format("drgate-capture").load(str(captures))
    df = df.persist(StorageLevel.MEMORY_AND_DISK)
    if job == "audit":
        tables = audit(df)
    elif job == "lag":
        tables = lag(df, window_s)
    else:
        tables = traffic(df, window_s)
    tables = {"segments": segments(df), **tables}
    frames: dict[str, Any] = {}
    try:
        for name, table in tables.items():
            step(f"computing {name}")
            frames[name] = table.toPandas()
    finally:
        df.unpersist()
    manifest = load_manifest(captures)
    if manifest is not None:
        frames = {
            "segments": frames["segments"],
            "coverage": coverage_table(manifest, frames["segments"]["segment"].tolist()),
            **frames,
        }
    step("writing tables, plots and report")
    target = Path(out) / job
    report.write_job_outputs(job, frames, target, window_s=window_s, manifest=manifest)
    if job == "audit" and len(frames["violations"]):
        return 1
    return 0


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m analysis.jobs", description="Analyse drgate capture segments."
        )
    parser.add_argument("job", choices=JOBS, help="audit, lag or traffic")
    parser.add_argument(
        "--captures", required=True, help="directory of capture segments (searched recursively)"
    )
    parser.add_argument("--out", default="drgate-analysis", help="output directory")
    parser.add_argument(
        "--master",
        default=DEFAULT_MASTER,
        help="Spark master URL (default local[2]; empty: leave it to spark-submit)",
    )
    parser.add_argument(
        "--window-s", type=int, default=DEFAULT_WINDOW_S, help="time window width in seconds"
    )
    parser.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE", help="a Spark setting"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        conf = []
        for item in args.conf:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise CaptureSourceError(f"--conf {item!r}: write KEY=VALUE")
            conf.append((key, value))
        check_captures(args.captures)
        check_master(args.master)
        spark = build_session(args.master, conf=conf)
        try:
            code = run_job(
                spark,
                args.job,
                args.captures,
                args.out,
                window_s=args.window_s,
                step=lambda what: print(f"{PROGRESS_PREFIX}{what}", file=sys.stderr, flush=True),
            )
        finally:
            spark.stop()
    except CaptureSourceError as exc:
        print(f"analysis: {exc}", file=sys.stderr)
        return 2
    except Exception:  # a crash must not read as "violations found" (exit 1)
        traceback.print_exc()
        return 3
    print(f"{args.job}: report in {Path(args.out) / args.job / 'report.html'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
