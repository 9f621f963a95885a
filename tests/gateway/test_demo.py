"""The two-site demo end to end (``drgate demo``), and ``drgate lab``'s refusals.

The demo test runs the whole thing for 20 s: two sites, four modes, the
active egress SIGKILLed halfway, and checks its exit status and summary.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from gateway.cli import main as drgate
from gateway.demo import DemoOptions, run_demo


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


def test_lab_up_on_corosync_says_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = drgate(["lab", "up", "--bus", "corosync", "--workdir", str(tmp_path)])
    assert code != 0
    err = capsys.readouterr().err
    assert "corosync" in err
    assert "not built yet" in err
    assert not (tmp_path / "lab.json").exists()


def test_lab_status_without_a_lab_says_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = drgate(["lab", "status", "--workdir", str(tmp_path)])
    assert code != 0
    assert "drgate lab up" in capsys.readouterr().err
