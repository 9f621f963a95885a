"""gateway/commands/analyze: argument checks that need no Spark session."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main


def test_missing_capture_directory_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    assert main(["analyze", "audit", "--captures", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "drgate analyze:" in err and str(missing) in err and "does not exist" in err
    assert "Traceback" not in err


def test_directory_without_segments_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "readme.txt").write_text("no segments here")
    assert main(["analyze", "lag", "--captures", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no capture segments" in err and "capture.directory" in err


def test_unknown_job_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["analyze", "bogus", "--captures", "."])
    assert "invalid choice" in capsys.readouterr().err
