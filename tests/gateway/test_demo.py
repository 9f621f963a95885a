"""The two-site demo end to end (``drgate demo``), and ``drgate lab``'s refusals.

The demo test runs the whole thing for 20 s: two sites, four modes, the
active egress SIGKILLed halfway, and checks its exit status and summary.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from gateway.cli import main as drgate
from gateway.demo import DemoOptions, run_demo
from lab.netns import list_netns
from tests.lab import require_corosync


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.slow
def test_demo_holds_every_invariant_through_an_egress_kill(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    code = run_demo(DemoOptions(duration_s=20, rate=50, workdir=tmp_path), console)
    text = out.getvalue()
    assert code == 0, text[-4000:]
    assert "all invariants hold" in text
    assert "FAIL" not in text
    for check in (
        "a standby takes over the egress",
        "full: D's replica digest == P's queue digest",
        "enqueue: D consumed every message once, in order",
        "wiring: queue exists at D and is empty",
        "none: queue absent at D",
    ):
        assert check in text
    assert "1000/1000 received, 0 duplicates, in order" in text


@pytest.mark.corosync
@pytest.mark.integration
@pytest.mark.slow
def test_lab_up_on_corosync_runs_both_sites_until_lab_down(tmp_path: Path) -> None:
    require_corosync()
    root = Path(__file__).resolve().parents[2]
    # Wide enough that rich does not cut the role column.
    env = dict(os.environ, PYTHONPATH=str(root), COLUMNS="250")
    argv = [sys.executable, "-m", "gateway.cli", "lab"]
    lab = subprocess.Popen(
        [*argv, "up", "--bus", "corosync", "--workdir", str(tmp_path)],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "lab.json").exists():
            assert lab.poll() is None, lab.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "lab up did not come up"
            time.sleep(0.5)  # waiting for another process's file: no event to await
        state = json.loads((tmp_path / "lab.json").read_text())
        assert state["bus"] == "corosync"
        assert all("10.213.2" in url for url in state["status"])
        status = subprocess.run(
            [*argv, "status", "--workdir", str(tmp_path)],
            cwd=root, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert "egress" in status.stdout
        assert "ingress" in status.stdout
        # From the operator's shell (this test's namespace, not a node's):
        # the command runs itself again in the namespace the config names.
        promote = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "promote", "--dry-run", "--json",
             "--config", str(tmp_path / "d" / "sidecar-1.yaml")],
            cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert promote.returncode == 0, promote.stderr
        assert json.loads(promote.stdout.strip().splitlines()[-1])["origin"] == "site-p"
        down = subprocess.run(
            [*argv, "down", "--workdir", str(tmp_path)],
            cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert down.returncode == 0, down.stderr
        assert lab.wait(timeout=120) == 0
    finally:
        if lab.poll() is None:
            # SIGTERM lets `lab up` stop every process it started; SIGKILL
            # would orphan them.
            lab.terminate()
            try:
                lab.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                lab.kill()
                lab.communicate()
        else:
            lab.communicate()
    assert [n for n in list_netns() if n.startswith(("dgP", "dgD"))] == []


def test_lab_status_without_a_lab_says_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = drgate(["lab", "status", "--workdir", str(tmp_path)])
    assert code != 0
    assert "drgate lab up" in capsys.readouterr().err
