"""lab/spark.py: the lab's standalone Spark cluster starts, runs an application
on both workers, and leaves no process behind, also when the block fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lab.spark import SparkCluster, pyspark_home, scala_version, session_pids


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_scala_version_comes_from_the_jars() -> None:
    assert scala_version(pyspark_home()) in {"2.12", "2.13", "3"}


def test_session_pids_finds_a_new_session_and_its_children() -> None:
    code = (
        "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'input()']); "
        "print(c.pid, flush=True); input()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as parent:
        assert parent.stdout is not None and parent.stdin is not None
        child = int(parent.stdout.readline())
        assert sorted(session_pids(parent.pid)) == sorted([parent.pid, child])
        parent.stdin.close()  # both read EOF from the shared pipe and end
    parent.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.integration
def test_cluster_runs_on_both_workers_and_stops_everything_when_the_block_fails(
    tmp_path: Path,
) -> None:
    from pyspark.sql import SparkSession

    seen: list[int] = []
    cluster = SparkCluster(workdir=tmp_path)
    builder = SparkSession.builder.appName("lab-check")
    # The driver stays up after the block: what its executors left, stop() must end.
    with pytest.raises(RuntimeError, match="the test failed here"), cluster:  # noqa: PT012
        assert cluster.alive_workers() == 2
        for key, value in cluster.spark_conf().items():
            builder = builder.config(key, value)
        spark = builder.master(cluster.master_url).getOrCreate()
        total = spark.range(0, 1000, numPartitions=4).selectExpr("sum(id)").first()
        assert total is not None and total[0] == 499500
        executors = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1
        assert executors == 2
        seen = cluster.pids()
        assert len(seen) >= 5, seen  # master, two workers, two executors (and their Pythons)
        raise RuntimeError("the test failed here")
    left = [pid for pid in seen if alive(pid)]
    spark.stop()
    assert not left, f"left behind: {left}"
    for n in (1, 2):
        assert list(cluster.worker_dir(n).glob("app-*/*/stderr")), f"no executor on worker {n}"
