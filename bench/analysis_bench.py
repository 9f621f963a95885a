"""Rows/s read by the drgate-capture data source next to Spark reading Parquet.

Writes N capture records (default 1 million) as segment files with
protocol/capture's writer, reads them through the data source, writes the
same rows as Parquet, and reads those back; both reads materialise every
column (the ``noop`` sink) and are timed after one warm-up run each.

    .venv/bin/python bench/analysis_bench.py [--records N] [--segments K] [--master URL]
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

from protocol.capture import CaptureRecord, CaptureRole, CaptureWriter, SegmentHeader, Stream
from protocol.modes import Mode


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


def timed_read(spark: Any, reader: Callable[[], Any], runs: int = 2) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        reader().write.format("noop").mode("overwrite").save()
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from pyspark.sql import SparkSession

    from analysis.source import CaptureDataSource

    tmp = Path(tempfile.mkdtemp(prefix="drgate-bench-"))
    try:
        captures = tmp / "captures"
        captures.mkdir()
        write_s = write_captures(captures, args.records, args.segments)
        records = args.records // args.segments * args.segments
        print(f"capture writer: {records} records in {write_s:.2f} s = {records / write_s:,.0f}/s")

        spark = (
            SparkSession.builder.master(args.master)
            .appName("drgate-analysis-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        spark.dataSource.register(CaptureDataSource)

        def capture_df() -> Any:
            return spark.read.format("drgate-capture").load(str(captures))

        rows = capture_df().count()
        parquet = tmp / "records.parquet"
        capture_df().repartition(args.segments).write.parquet(str(parquet))

        source_s = timed_read(spark, capture_df)
        parquet_s = timed_read(spark, lambda: spark.read.parquet(str(parquet)))
        source_rate = rows / source_s
        parquet_rate = rows / parquet_s
        print(f"rows: {rows} in {args.segments} segments, master {args.master}")
        print(f"drgate-capture data source: {source_s:.2f} s = {source_rate:,.0f} rows/s")
        print(f"Parquet (same rows):        {parquet_s:.2f} s = {parquet_rate:,.0f} rows/s")
        print(f"ratio data source / Parquet: {source_rate / parquet_rate:.2f} (target >= 0.5)")
        spark.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
