"""The analysis jobs on a standalone Spark cluster give the tables they give on local[2].

A master and two workers (lab/spark.py) run on loopback from the pyspark
package's jars; ``drgate analyze audit|lag|traffic --master spark://...`` runs
there, as an operator runs it: a ``drgate`` process of its own (in this
process, the suite's local[2] session would be reused and the master
ignored), over the captures of a two-site run (tests/analysis/twosite.py:
three sidecars at P, one at D, each with its own capture directory, gathered
by ``drgate capture collect``), so the data source's ``read()`` runs in
executor processes and only its planning on the driver.  The same jobs run on
the suite's local[2] session; every table must be equal.  The run has a fault (an
event D never applied) and a cut segment, so the audit's verdict is
"violations" on both, and the coverage comes from the manifest.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from gateway.cli import main
from lab.site import ROOT, drgate_argv
from lab.spark import SparkCluster, alive
from protocol.capture import CaptureRole, SegmentHeader, Stream
from protocol.cluster import Kind
from tests.analysis import twosite

# The cluster's start and the audit on it run in CI (make test); the lag and
# traffic jobs on it add a minute or more each and run with make test-long.
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.integration]

EVENTS = 3000  # 12.5 minutes of the run at 4 events/s: 75 windows of 10 s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    lab = SparkCluster(workdir=tmp_path_factory.mktemp("spark-lab"))
    with lab:
        yield lab
        seen = lab.pids()
    assert seen, "no cluster process seen"
    left = [pid for pid in seen if alive(pid)]
    assert not left, f"cluster processes left behind: {left}"


@pytest.fixture(scope="module")
def collected(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-site run's segments, one directory per sidecar, collected into one."""
    work = tmp_path_factory.mktemp("twosite")
    run = twosite.plan(EVENTS)
    dropped = twosite.event(run, Kind.PUBLISH, "orders", 5)
    run.applied = [a for a in run.applied if a.event is not dropped]
    twosite.write(run, work / "written", forwarded_segments=3, cut_last=True)
    sidecars = {name: work / "sidecars" / name for name in ("p1", "p2", "p3", "d1")}
    for path in sorted((work / "written").iterdir()):
        target = sidecars["d1" if path.name.startswith("d1-") else "p1"]
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / path.name)
    for node in (2, 3):  # standbys at P tap what node 1 taps
        header = SegmentHeader(
            "primary", node, CaptureRole.STANDBY, Stream.TAPPED, twosite.T0, twosite.INC_P
        )
        data = twosite.segment_bytes(header, run.tapped, end_us=twosite.T0 + 10**10)
        sidecars[f"p{node}"].mkdir(parents=True)
        (sidecars[f"p{node}"] / f"p{node}-tapped-0000.cap").write_bytes(data)
    out = work / "collected"
    assert main(["capture", "collect", "--out", str(out), *map(str, sidecars.values())]) == 0
    return out


def tables(directory: Path) -> dict[str, pd.DataFrame]:
    found = {}
    for path in sorted((directory / "tables").glob("*.parquet")):
        frame = pd.read_parquet(path)
        if "segment" in frame:
            frame["segment"] = frame["segment"].str.removeprefix("file://")
        found[path.stem] = frame.sort_values(list(frame.columns)).reset_index(drop=True)
    return found


# How many of the cluster's applications the tests before saw (module state:
# the cluster lives for the module).
ran: dict[str, int] = {}


@pytest.mark.parametrize(
    ("job", "code"),
    [
        ("audit", 1),
        pytest.param("lag", 0, marks=pytest.mark.long),
        pytest.param("traffic", 0, marks=pytest.mark.long),
    ],
)
def test_job_on_the_cluster_gives_the_local_tables(
    spark: Any, cluster: SparkCluster, collected: Path, tmp_path: Path, job: str, code: int
) -> None:
    from analysis import jobs

    assert jobs.run_job(spark, job, collected, tmp_path / "local") == code
    # the audit reads the captures through a file:// URI, the others through the path
    captures = collected.as_uri() if job == "audit" else str(collected)
    conf = {**cluster.spark_conf(), "spark.sql.shuffle.partitions": "4"}
    argv = ["analyze", job, "--captures", captures, "--out", str(tmp_path / "cluster")]
    argv += ["--master", cluster.master_url]
    for key, value in conf.items():
        argv += ["--conf", f"{key}={value}"]
    done = subprocess.run(
        drgate_argv(*argv), capture_output=True, text=True, timeout=600, cwd=ROOT, check=False
    )
    assert done.returncode == code, done.stderr[-2000:]

    local, remote = tables(tmp_path / "local" / job), tables(tmp_path / "cluster" / job)
    assert sorted(remote) == sorted(local)
    assert {"segments", "coverage"} <= set(local)
    for name, frame in local.items():
        pd.testing.assert_frame_equal(remote[name], frame, obj=f"{job} table {name}")
    # what the jobs are about, so that equal tables are not equally empty
    coverage = local["coverage"].set_index(["site", "node", "stream"])
    assert coverage.loc[("dr", 1, "ingested"), "cut_segments"] == 1
    assert len(coverage) == 5 and coverage["missing_segments"].sum() == 0
    if job == "audit":
        violations = local["violations"]
        assert set(violations["violation"]) == {"missing_at_d"}
        assert len(violations) == 1  # the dropped event
        # the torn last record (a publish to two queues): after D's capture ends
        assert len(local["not_captured"]) == 2
        per_queue = local["per_queue"].set_index("queue")
        assert per_queue.loc["orders", "forwarded"] > 500
        page = (tmp_path / "cluster" / job / "report.html").read_text()
        assert "Coverage from manifest.json" in page and "1 violation(s)" in page
    if job == "lag":
        assert local["overall"]["events"].sum() > 1000

    # the job was an application of the cluster, its work done in executors on
    # both workers, not in the driver
    apps = [a for a in cluster.state()["completedapps"] if a["name"] == "drgate-analyze"]
    assert len(apps) == ran.setdefault("apps", 0) + 1, "the job did not run on the cluster"
    ran["apps"] = len(apps)
    for n in (1, 2):
        executors = cluster.worker_dir(n).glob(f"{apps[-1]['id']}/*/stderr")
        assert list(executors), f"no executor of {apps[-1]['id']} on worker {n}"
