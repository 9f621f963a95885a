"""drgate rules check / explain."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "deploy" / "rules" / "example.yaml")


def test_check_valid_file_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "check", EXAMPLE]) == 0
    assert "ok: 6 rules and a default, 0 warnings" in capsys.readouterr().out


def test_check_invalid_file_exits_1_with_every_located_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nrules:\n  - {name: a, match: {qeue: q}, action: {mode: ful}}\n")
    assert main(["rules", "check", str(bad)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"{bad}:1:1: error: missing key 'default' in the rules file (hint: every rules file "
        "needs a default action, e.g. 'default: {mode: from-args, fallback: none}')",
        f"{bad}:3:23: error: unknown key 'qeue' in 'match' (hint: did you mean 'queue'? valid: "
        "queue, queue_regex, exchange, routing_key, headers, args)",
        f"{bad}:3:48: error: unknown mode 'ful' (hint: did you mean 'full'? valid: full, "
        "enqueue, wiring, none, from-args)",
        f"{bad}: invalid: 3 errors",
    ]


def test_check_prints_warnings_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "w.yaml"
    f.write_text(
        "version: 1\nrules:\n  - {name: all, match: {}, action: {mode: full}}\n"
        "default: {mode: none}\n"
    )
    assert main(["rules", "check", str(f)]) == 0
    out = capsys.readouterr()
    assert f"{f}:4:10: warning: the default action is never used" in out.err
    assert "1 warning" in out.out


def test_check_missing_file_is_a_message_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["rules", "check", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read the rules file: No such file or directory" in capsys.readouterr().err


def test_explain_message_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "explain", EXAMPLE, "--queue", "trades", "--header", "region=uk"]) == 0
    out = capsys.readouterr().out
    assert "rule:        trades-eu (" in out and "example.yaml:32)" in out
    assert "mode:        enqueue" in out


def test_explain_queue_from_args_and_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "explain", EXAMPLE, "--queue", "orders"]) == 0
    out = capsys.readouterr().out
    assert "name at D:   dr.orders" in out
    assert main(["rules", "explain", EXAMPLE, "--queue", "q", "--arg", "qpid.replicate=all"]) == 0
    out = capsys.readouterr().out
    assert "from-args: qpid.replicate=all" in out
    assert "mode:        full" in out


def test_explain_drop(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["rules", "explain", EXAMPLE, "--queue", "orders", "--header", "x-local-only=1"]
    assert main(argv) == 0
    assert "dropped (header: x-local-only exists)" in capsys.readouterr().out
