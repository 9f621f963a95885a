"""Qpid's spellings: ``drgate admin add-queue --generate-queue-events N`` and
``--replicate all|configuration|none`` set the arguments qpid-config sets, and
``drgate rules explain`` with every shipped example rules file gives the mode
docs/rules.md's table says (the table is read from the docs, so it cannot
drift); ``drgate replicate QUEUE MODE`` re-declares an existing queue."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import build_parser, main
from gateway.commands import admin
from gateway.commands.admin import AdminError, replication_args, request_for

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "rules"
# A queue no rule of the example names: the default (from-args) decides.
UNNAMED = {"wiring-only.yaml": "tmp.q"}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["admin", "--broker", "amqp://127.0.0.1:5672", *argv])


def docs_table() -> list[tuple[list[str], dict[str, str] | None, str]]:
    """docs/rules.md "Qpid's spellings": (admin argv, arguments or None for
    "both", mode) per row."""
    text = (ROOT / "docs" / "rules.md").read_text(encoding="utf-8")
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `drgate admin add-queue"):
            continue
        command, arguments, mode = (cell.strip() for cell in line.strip("|").split("|"))
        argv = shlex.split(command.strip("`"))[2:]
        pairs = re.findall(r"`([\w.]+)=(\w+)`", arguments)
        rows.append((argv, dict(pairs) if pairs else None, mode.strip("`")))
    return rows


TABLE = docs_table()


def test_the_docs_table_covers_qpids_and_drgates_spellings() -> None:
    spelled = {" ".join(argv[2:]) for argv, _, _ in TABLE}
    assert {"--generate-queue-events 1", "--generate-queue-events 2"} <= spelled
    assert {f"--replicate {v}" for v in ("all", "configuration", "none")} <= spelled
    assert {f"--replicate {v}" for v in ("full", "enqueue", "wiring")} <= spelled


@pytest.mark.parametrize(("argv", "expected", "mode"), TABLE, ids=[" ".join(r[0]) for r in TABLE])
def test_admin_sets_qpids_arguments_and_explain_gives_the_mode(
    argv: list[str],
    expected: dict[str, str] | None,
    mode: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    arguments = request_for(parse(*argv))["args"]
    if expected is not None:
        assert {k: str(v) for k, v in arguments.items()} == expected
    pairs = [a for k, v in arguments.items() for a in ("--arg", f"{k}={v}")]
    for path in sorted(RULES.glob("*.yaml")):
        queue = UNNAMED.get(path.name, "q")
        capsys.readouterr()
        assert main(["rules", "explain", str(path), "--queue", queue, *pairs]) == 0
        out = capsys.readouterr().out
        assert f"mode:        {mode}\n" in out, (path.name, out)
        assert "how:         from-args:" in out, (path.name, out)


def test_qpid_config_spellings_are_the_arguments_qpid_sets() -> None:
    assert replication_args(None, 2) == {"qpid.queue_event_generation": 2}
    assert replication_args("all") == {"qpid.replicate": "all"}
    assert replication_args("all", 1) == {
        "qpid.replicate": "all",
        "qpid.queue_event_generation": 1,
    }
    assert replication_args("configuration", 2) == {
        "qpid.replicate": "configuration",
        "qpid.queue_event_generation": 2,
    }
    # drgate's own mode with the generation it implies is no contradiction.
    assert replication_args("full", 2) == replication_args("full")


@pytest.mark.parametrize(("mode", "events"), [("full", 1), ("enqueue", 2)])
def test_a_drgate_mode_and_a_contradicting_event_generation_are_refused(
    mode: str, events: int
) -> None:
    with pytest.raises(AdminError, match=f"--replicate {mode} means qpid.queue_event_generation"):
        request_for(
            parse("add-queue", "q", "--replicate", mode, "--generate-queue-events", str(events))
        )


def test_generate_queue_events_takes_only_1_or_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("add-queue", "q", "--generate-queue-events", "3")
    assert "invalid choice: 3" in capsys.readouterr().err


# -- drgate replicate -----------------------------------------------------------------


class FakeBroker:
    """Stands in for admin.describe / admin.send_request."""

    def __init__(self, queues: dict[str, dict[str, Any]]) -> None:
        self.queues = queues
        self.sent: list[dict[str, Any]] = []

    def describe(self, url: str) -> dict[str, Any]:
        return {"queues": [{"name": n, "args": a} for n, a in self.queues.items()]}

    def send_request(self, url: str, request: dict[str, Any]) -> None:
        self.sent.append(request)


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> FakeBroker:
    fake = FakeBroker({"orders": {"qpid.replicate": "all", "qpid.queue_event_generation": 1}})
    monkeypatch.setattr(admin, "describe", fake.describe)
    monkeypatch.setattr(admin, "send_request", fake.send_request)
    return fake


def test_replicate_redeclares_the_queue_with_the_modes_arguments(
    broker: FakeBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replicate", "orders", "full", "--broker", "amqp://b:5672"]) == 0
    assert broker.sent == [
        {
            "op": "add-queue",
            "name": "orders",
            "args": {"qpid.replicate": "all", "qpid.queue_event_generation": 2},
        }
    ]
    assert "mode full" in capsys.readouterr().out


def test_replicate_with_qpids_value_keeps_the_queues_event_generation(
    broker: FakeBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    # As in Qpid: --replicate all leaves qpid.queue_event_generation=1 in force.
    assert main(["replicate", "orders", "all", "--broker", "amqp://b:5672"]) == 0
    assert broker.sent[0]["args"] == {"qpid.replicate": "all"}
    assert "mode enqueue" in capsys.readouterr().out


def test_replicate_refuses_a_queue_the_site_does_not_have(
    broker: FakeBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replicate", "nope", "wiring", "--broker", "amqp://b:5672"]) == 1
    err = capsys.readouterr().err
    assert "amqp://b:5672 has no queue 'nope'" in err
    assert "drgate admin --broker amqp://b:5672 add-queue nope --replicate wiring" in err
    assert broker.sent == []
