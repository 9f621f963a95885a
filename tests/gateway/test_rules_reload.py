"""Editing the rules file of a running primary site switches every tap at one
cseq; a bad edit changes nothing and says where the mistake is.

Two sites of three brokers and three sidecars (lab.site.TwoSites), the
embedded bus, Proton clients.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.site import LAB_RULES, TwoSites, finish_client
from tests.lab import converged, queues, replace_file, status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

ORDERS_FULL = """\
version: 1
rules:
  - name: orders
    match: {queue: orders}
    action: {mode: full}
default:
  mode: from-args
  fallback: none
"""
# The same edit with a typo in the mode (line 5, column 22).
ORDERS_TYPO = ORDERS_FULL.replace("mode: full", "mode: fll")


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    replace_file(path, LAB_RULES.read_text())
    return path


@pytest.fixture
def two(tmp_path: Path, rules: Path) -> Iterator[TwoSites]:
    with TwoSites(workdir=tmp_path / "lab", metrics=True, rules=rules) as sites:
        for queue, mode in (("q-full", "full"), ("orders", None)):
            args = ("--replicate", mode) if mode else ()
            done = sites.p.admin(1, "add-queue", queue, *args)
            assert done.returncode == 0, done.stderr
        yield sites


def publish(two: TwoSites, queue: str, count: int, start: int = 1) -> int:
    popen = two.p.client_popen(
        1, "publish", two.p.amqp[1], queue, "--count", str(count), "--start", str(start)
    )
    accepted: int = finish_client(popen)["accepted"]
    return accepted


def test_an_edited_rules_file_switches_every_tap_and_a_bad_edit_changes_nothing(
    two: TwoSites, rules: Path
) -> None:
    assert publish(two, "orders", 100) == 100
    assert publish(two, "q-full", 10) == 10
    wait_for("the link carries q-full", lambda: converged(two))
    assert "orders" not in queues(two.d.describe(1))  # from-args, no arguments: none

    replace_file(rules, ORDERS_TYPO)
    wait_for(
        "every P sidecar reports the bad file",
        lambda: all("fll" in status(two, "site-p", n)["rules_file_problem"] for n in two.nodes),
    )
    problem = status(two, "site-p", 1)["rules_file_problem"]
    assert f"{rules}:5:" in problem and "rules in force (version 0) stay" in problem
    assert all(status(two, "site-p", n)["rules_version"] == 0 for n in two.nodes)
    assert status(two, "site-p", 2)["rules_reload_failures"] == 1

    replace_file(rules, ORDERS_FULL)
    wait_for(
        "every tap applied the new rules",
        lambda: [status(two, "site-p", n)["rules_version"] for n in two.nodes] == [1, 1, 1],
    )
    digests = {status(two, "site-p", n)["rules_digest"] for n in two.nodes}
    assert len(digests) == 1
    wait_for(
        "every P sidecar sees its file in force",
        lambda: all(status(two, "site-p", n)["rules_file_problem"] == "" for n in two.nodes),
    )
    # orders switched from none to full at the switch's cseq: its 100 messages
    # are resynced to D, and what follows is mirrored.
    wait_for("D's orders equals P's", lambda: converged(two, queue="orders"))
    assert publish(two, "orders", 20, start=101) == 20
    wait_for("D's orders equals P's again", lambda: converged(two, queue="orders"))
    d = queues(two.d.describe(2))["orders"]
    assert d["depth"] == 120 and d["replica"]["mode"] == "full"
