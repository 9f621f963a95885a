"""The rules file watcher of a primary sidecar (gateway/ruleswatch.py): what
it proposes, what it refuses, and that it says so once per bad content."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from filters.rules import load_rules
from filters.switch import apply_switch
from gateway.ruleswatch import RulesWatcher
from protocol.modes import Mode
from tests.lab import replace_file

START = "version: 1\nrules: []\ndefault:\n  mode: from-args\n  fallback: none\n"
ORDERS_FULL = (
    "version: 1\nrules:\n  - name: orders\n    match: {queue: orders}\n"
    "    action: {mode: full}\ndefault:\n  mode: from-args\n  fallback: none\n"
)
BAD = "version: 1\nrules:\n  - name: orders\n    match: {queue: orders}\n    action: {mode: fll}\n"


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    replace_file(path, START)
    return path


def test_the_file_as_loaded_is_not_proposed(rules_file: Path) -> None:
    watcher = RulesWatcher(str(rules_file))
    watcher.start_from()
    assert watcher.poll(load_rules(START, str(rules_file))) is None


def test_a_valid_edit_is_proposed_and_applies_as_the_next_version(rules_file: Path) -> None:
    in_force = load_rules(START, str(rules_file))
    watcher = RulesWatcher(str(rules_file))
    watcher.start_from()
    replace_file(rules_file, ORDERS_FULL)
    payload = watcher.poll(in_force)
    assert payload is not None and payload.text == ORDERS_FULL
    switched = apply_switch(in_force, payload, cseq=42)
    assert switched.rules_version == 1 and switched.cseq == 42
    assert switched.decide_queue("orders", {}).mode == Mode.FULL
    assert watcher.poll(switched) is None  # nothing new on disk


def test_an_invalid_edit_keeps_the_rules_and_is_reported_once(
    rules_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    in_force = load_rules(START, str(rules_file))
    watcher = RulesWatcher(str(rules_file))
    watcher.start_from()
    replace_file(rules_file, BAD)
    with caplog.at_level(logging.ERROR, logger="drgate.rules"):
        assert watcher.poll(in_force) is None
        replace_file(rules_file, BAD + "\n")  # touched again, same mistake, other bytes
        assert watcher.poll(in_force) is None
        replace_file(rules_file, BAD + "\n")  # written again, the very same content
        assert watcher.poll(in_force) is None  # not logged or counted again
    assert watcher.failures == 2
    assert [r.getMessage().count("fll") > 0 for r in caplog.records] == [True, True]
    assert "rules in force (version 0) stay" in watcher.problem
    assert f"{rules_file}:5" in watcher.problem  # file and line of the mistake
    replace_file(rules_file, START)  # put back: the problem clears, nothing to propose
    assert watcher.poll(in_force) is None
    assert watcher.problem == ""


def test_a_missing_file_is_a_problem_not_a_crash(rules_file: Path) -> None:
    in_force = load_rules(START, str(rules_file))
    watcher = RulesWatcher(str(rules_file))
    watcher.start_from()
    rules_file.unlink()
    assert watcher.poll(in_force) is None
    assert "cannot read the rules file" in watcher.problem
