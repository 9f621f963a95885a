"""lab/spark.py: the lab's standalone Spark cluster starts, runs an application
on both workers, and leaves no process behind, also when the block fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab.spark import SparkCluster, alive, pyspark_home, scala_version, session_pids


def test_scala_version_comes_from_the_jars() -> None:
    assert scala_version(pyspark_home()) in {"2.12", "2.13", "3"}


def test_session_pids_finds_a_new_session_and_its_children() -> None:
    code = (
        "import subprocess, sys; "
        "c = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()']); "
        "print(c.pid, flush=True); sys.stdin.read()"
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


# A driver in a process of its own (this process may hold another session: the
# analysis suite's local[2] one): it runs a small job, says how many executors
# it has, and keeps its application up until its stdin closes.
DRIVER = """
import json, sys
from pyspark.sql import SparkSession
builder = SparkSession.builder.appName("lab-check").master(sys.argv[1])
for key, value in json.loads(sys.argv[2]).items():
    builder = builder.config(key, value)
spark = builder.getOrCreate()
total = spark.range(0, 1000, numPartitions=4).selectExpr("sum(id)").first()[0]
executors = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1
print(json.dumps({"total": total, "executors": executors}), flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.integration
@pytest.mark.long
def test_cluster_runs_on_both_workers_and_stops_everything_when_the_block_fails(
    tmp_path: Path,
) -> None:
    seen: list[int] = []
    cluster = SparkCluster(workdir=tmp_path / "lab")
    driver: subprocess.Popen[str] | None = None
    log = (tmp_path / "driver.log").open("w")
    try:
        # The application is still up when the block fails: stop() must end its executors.
        with pytest.raises(RuntimeError, match="the test failed here"), cluster:  # noqa: PT012
            assert cluster.alive_workers() == 2
            conf = json.dumps(cluster.spark_conf())
            driver = subprocess.Popen(
                [sys.executable, "-c", DRIVER, cluster.master_url, conf],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            assert driver.stdout is not None
            said = json.loads(driver.stdout.readline() or "{}")
            assert said == {"total": 499500, "executors": 2}, (tmp_path / "driver.log").read_text()
            seen = cluster.pids()
            assert len(seen) >= 5, seen  # master, two workers, two executors (and their Pythons)
            raise RuntimeError("the test failed here")
        left = [pid for pid in seen if alive(pid)]
        assert not left, f"left behind: {left}"
        for n in (1, 2):
            assert list(cluster.worker_dir(n).glob("app-*/*/stderr")), f"no executor on worker {n}"
    finally:
        if driver is not None:
            driver.kill()  # its cluster is gone; nothing to stop cleanly
            driver.communicate(timeout=30)  # and close its pipes
        log.close()
