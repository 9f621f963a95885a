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


def _segment_dir(tmp_path: Path) -> Path:
    from tests.analysis import twosite

    directory = tmp_path / "captures"
    twosite.write(twosite.plan(10), directory)
    return directory


def test_unreachable_master_names_the_url_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = f"spark://127.0.0.1:{port}"
    captures = _segment_dir(tmp_path)
    assert main(["analyze", "audit", "--captures", str(captures), "--master", master]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach the Spark master {master}" in err
    assert "--master local[2]" in err and "Traceback" not in err


def test_malformed_master_and_conf_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    captures = str(_segment_dir(tmp_path))
    assert main(["analyze", "lag", "--captures", captures, "--master", "spark://nohost"]) == 1
    assert "spark://HOST:PORT" in capsys.readouterr().err
    assert main(["analyze", "lag", "--captures", captures, "--conf", "spark.x"]) == 1
    assert "KEY=VALUE" in capsys.readouterr().err


def test_file_uri_captures_are_checked_like_a_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = (tmp_path / "nowhere").as_uri()
    assert main(["analyze", "traffic", "--captures", missing]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["analyze", "traffic", "--captures", (tmp_path / "empty").as_uri()]) == 1
    assert "no capture segments" in capsys.readouterr().err
