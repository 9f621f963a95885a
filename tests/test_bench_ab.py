"""bench/ab.py reads bench/e2e_bench.py's tables, and nothing else, cell by cell."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import ab

RUN = """\
CPU at 500 msgs/s offered, 3 node(s) per site ...

process role (µs CPU / message delivered at D)            500/s offered            1000/s offered
P broker receiving the publishes                          100 / 313 each            152 / 153 each
all processes                                                       2840                      1542
of which in the kernel (system time)                                 11%                       10%
lag p50 / p99 (ms)                                           31 /   44               36 /   45
profile burst, 3 node(s) per site (py-spy) ...                   starting                      now
"""


def test_every_cell_of_a_table_is_read_under_its_row_and_column() -> None:
    cells = ab.parse_tables(RUN)
    assert cells == {
        ("P broker receiving the publishes", "500/s offered"): "100 / 313 each",
        ("P broker receiving the publishes", "1000/s offered"): "152 / 153 each",
        ("all processes", "500/s offered"): "2840",
        ("all processes", "1000/s offered"): "1542",
        ("of which in the kernel (system time)", "500/s offered"): "11%",
        ("of which in the kernel (system time)", "1000/s offered"): "10%",
        ("lag p50 / p99 (ms)", "500/s offered"): "31 / 44",
        ("lag p50 / p99 (ms)", "1000/s offered"): "36 / 45",
    }


def test_rounds_of_both_trees_stand_side_by_side_per_column() -> None:
    base = [ab.parse_tables(RUN), ab.parse_tables(RUN.replace("2840", "2900"))]
    head = [ab.parse_tables(RUN.replace("2840", "2500"))]
    text = ab.side_by_side(base, head)
    assert "500/s offered: BASE rounds | this tree's rounds" in text
    assert "2840; 2900  |  2500" in text
    assert "1542; 1542  |  1542" in text


def test_a_run_that_must_wait_for_the_lock_says_so_and_then_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = tmp_path / "corosync.lock"
    monkeypatch.setattr(ab, "LOCK", lock)
    ran: list[list[str]] = []

    def bench(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        ran.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="the tables", stderr="")

    monkeypatch.setattr(ab.subprocess, "run", bench)
    with lock.open("a") as held:  # another holder: a description of its own
        fcntl.flock(held, fcntl.LOCK_EX)
        outputs: list[str] = []
        worker = threading.Thread(target=lambda: outputs.append(ab.run(tmp_path, ["--x"])))
        worker.start()
        deadline = time.monotonic() + 10
        said = ""
        while "waiting for" not in said and time.monotonic() < deadline:
            said += capsys.readouterr().out
            worker.join(0.01)  # the run's thread, on a deadline, not a sleep
        assert f"waiting for {lock}" in said
        assert not ran, "the bench ran while another held the lock"
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(10)
    assert outputs == ["the tables"] and ran
