"""Rows/s read by the drgate-capture data source next to Spark reading Parquet,
on local[2] and on a standalone cluster of two workers, in one run.

Writes N capture records (default 10 million) as K segment files with
protocol/capture's writer, writes the same rows once as Parquet, then on each
master reads both: every column materialised (the ``noop`` sink), best of
two runs.  The cluster is the lab's (lab/spark.py): a master and two workers
of one core each, started from the pyspark package's jars on loopback and
stopped at the end; its executors are separate processes that read the
segments through the shared path (or ``--uri``: a file:// URI).

    .venv/bin/python bench/analysis_bench.py [--records N] [--segments K] [--no-cluster]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.spark import SparkCluster
from protocol.capture import CaptureRecord, CaptureRole, CaptureWriter, SegmentHeader, Stream
from protocol.modes import Mode

LOCAL = "local[2]"


def write_captures(directory: Path, records: int, segments: int) -> float:
    started = time.perf_counter()
    per_segment = records // segments
    modes = [Mode.FULL, Mode.ENQUEUE, Mode.WIRING]
    cseq = 0
    for s in range(segments):
        header = SegmentHeader("primary", 1, CaptureRole.EGRESS, Stream.FORWARDED, 0, 77)
        with open(directory / f"forwarded-{s:04d}.cap", "wb") as fh:
            writer = CaptureWriter(fh, header)
            for i in range(per_segment):
                cseq += 1
                writer.append(
                    CaptureRecord(
                        wall_time_us=1_700_000_000_000_000 + cseq * 100,
                        cseq=cseq,
                        kind=7,
                        mode=modes[i % 3],
                        queues=(f"queue-{i % 50}",),
                        size=200 + i % 64,
                        wire_size=40,
                        rule_id=i % 5,
                        rule_name=f"rule-{i % 5}",
                    )
                )
                if i % 4096 == 4095:
                    writer.flush()
            writer.close(1_700_000_000_000_000 + cseq * 100)
    return time.perf_counter() - started


def timed_read(reader: Callable[[], Any], runs: int = 2) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        reader().write.format("noop").mode("overwrite").save()
        best = min(best, time.perf_counter() - started)
    return best


def session(master: str, conf: dict[str, str]) -> Any:
    from pyspark.sql import SparkSession

    from analysis.source import CaptureDataSource

    builder = (
        SparkSession.builder.master(master)
        .appName(f"drgate-analysis-bench {master}")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(CaptureDataSource)
    return spark


def measure(
    master: str, conf: dict[str, str], captures: str, parquet: Path, rows: int
) -> tuple[float, float]:
    """(data source rows/s, Parquet rows/s) on ``master``."""
    spark = session(master, conf)
    try:
        got = spark.read.format("drgate-capture").load(captures).count()
        assert got == rows, f"{master}: read {got} rows, wrote {rows}"
        source_s = timed_read(lambda: spark.read.format("drgate-capture").load(captures))
        parquet_s = timed_read(lambda: spark.read.parquet(str(parquet)))
    finally:
        spark.stop()
    source_rate, parquet_rate = rows / source_s, rows / parquet_s
    print(f"{master}: drgate-capture data source: {source_s:.2f} s = {source_rate:,.0f} rows/s")
    print(f"{master}: Parquet (same rows):        {parquet_s:.2f} s = {parquet_rate:,.0f} rows/s")
    print(
        f"{master}: ratio data source / Parquet: {source_rate / parquet_rate:.2f} (target >= 0.5)"
    )
    return source_rate, parquet_rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--segments", type=int, default=16)
    parser.add_argument("--no-cluster", action="store_true", help="local[2] only")
    parser.add_argument(
        "--uri", action="store_true", help="the cluster reads the captures through a file:// URI"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    tmp = Path(tempfile.mkdtemp(prefix="drgate-bench-"))
    results: dict[str, tuple[float, float]] = {}
    try:
        captures = tmp / "captures"
        captures.mkdir()
        write_s = write_captures(captures, args.records, args.segments)
        rows = args.records // args.segments * args.segments
        print(f"capture writer: {rows:,} records in {write_s:.1f} s = {rows / write_s:,.0f}/s")
        parquet = tmp / "records.parquet"
        spark = session(LOCAL, {})
        started = time.perf_counter()
        spark.read.format("drgate-capture").load(str(captures)).repartition(
            args.segments
        ).write.parquet(str(parquet))
        spark.stop()
        print(f"Parquet copy written in {time.perf_counter() - started:.1f} s")
        print(f"rows: {rows:,} in {args.segments} segments")

        results[LOCAL] = measure(LOCAL, {}, str(captures), parquet, rows)
        if not args.no_cluster:
            started = time.perf_counter()
            with SparkCluster(workdir=tmp / "spark-lab") as cluster:
                print(f"cluster of 2 workers up in {time.perf_counter() - started:.1f} s")
                location = captures.as_uri() if args.uri else str(captures)
                results["cluster"] = measure(
                    cluster.master_url, cluster.spark_conf(), location, parquet, rows
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"{'master':<10} {'data source rows/s':>20} {'Parquet rows/s':>16} {'ratio':>6}")
    for name, (source, parq) in results.items():
        print(f"{name:<10} {source:>20,.0f} {parq:>16,.0f} {source / parq:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
