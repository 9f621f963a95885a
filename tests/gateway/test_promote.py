"""Failover end to end: ``drgate promote`` at D, the old primary fenced at the
handshake, and a primary restarted from nothing (a new incarnation) refused
until ``drgate resync --accept-incarnation``, which re-seeds D.

Two sites of three brokers and three sidecars (lab.site.TwoSites).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.site import ROOT, TwoSites, drgate_argv, finish_client
from tests.lab import converged, metric, queues, status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

MODES = {"q-full": "full", "q-enq": "enqueue", "q-wire": "wiring"}


def drgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        drgate_argv(*args), capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )


def add_queues(two: TwoSites) -> None:
    for queue, mode in MODES.items():
        done = two.p.admin(1, "add-queue", queue, "--replicate", mode)
        assert done.returncode == 0, done.stderr


def reconnects(two: TwoSites, site: str) -> float:
    """Link connections after the first, over the site's sidecars (the active
    egress's count grows with each attempt)."""
    return sum(metric(two, site, "drgate_link_reconnects_total", n) or 0 for n in two.nodes)


def spool_last_seq(two: TwoSites, node: int) -> float:
    return metric(two, "site-p", "drgate_spool_last_seq", node) or 0


def publish(two: TwoSites, queue: str, count: int) -> int:
    popen = two.p.client_popen(1, "publish", two.p.amqp[1], queue, "--count", str(count))
    accepted: int = finish_client(popen)["accepted"]
    return accepted


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoSites]:
    with TwoSites(workdir=tmp_path, metrics=True) as sites:
        add_queues(sites)
        yield sites


def test_promote_makes_full_replicas_writable_and_fences_the_old_primary(two: TwoSites) -> None:
    assert publish(two, "q-full", 200) == 200
    wait_for("D's full replica equals P's queue", lambda: converged(two))
    config = str(two.d.workdir / "sidecar-2.yaml")

    dry = drgate("promote", "--config", config, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    figures = json.loads(dry.stdout)
    assert figures["applied_cseq"] > 0 and figures["origin_time_us"] > 0
    assert not figures["promoted"]
    refused = two.d.client(1, "publish", two.d.amqp[1], "q-full", "--count", "1")
    assert "read-only" in (refused["error"] or refused["first_rejection"])

    before_us = time.time() * 1e6
    done = drgate("promote", "--config", config, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["promoted"] and result["epoch"] >= 1
    # P's clients were quiet, but its egress posts a verification point every
    # link.verify_s (60 s), which a slow run can meet between the two calls.
    assert result["applied_cseq"] >= figures["applied_cseq"]
    # The RPO printed is "now - the origin time of the last applied event".
    expected = (before_us - result["origin_time_us"]) / 1e6
    assert expected <= result["rpo_seconds"] <= expected + 30

    published = two.d.client(1, "publish", two.d.amqp[1], "q-full", "--count", "5")
    assert published["accepted"] == 5, published
    consumed = two.d.client(1, "consume", two.d.amqp[1], "q-full", "--count", "5")
    assert consumed["received"] == 5

    # The old primary keeps running: its egress is refused with the promotion,
    # and its brokers stop settling publishes to its full queues (zombie guard).
    wait_for(
        "P's egress reports the promotion",
        lambda: "was promoted" in status(two, "site-p", 1)["last_error"],
    )
    wait_for("P's zombie guard is on", lambda: status(two, "site-p", 1)["superseded_by"])
    zombie = two.p.client(2, "publish", two.p.amqp[2], "q-full", "--count", "1")
    assert zombie["accepted"] == 0, zombie
    reason = zombie["error"] or zombie["first_rejection"]
    assert "site-d was promoted over site-p" in reason, reason
    assert publish(two, "q-enq", 10) == 10  # enqueue queues are not guarded by default
    # Nothing of that may reach D: shown once P's egress has tried D again
    # since (a reconnect that leaked them would have sent them by then).
    tried = reconnects(two, "site-p")
    wait_for(
        "P's refused egress tries D twice more",
        lambda: reconnects(two, "site-p") >= tried + 2,
        timeout=30,
    )
    d = queues(two.d.describe(2))
    assert d["q-full"]["depth"] == 200, "a fenced primary's messages reached D"
    assert d.get("q-enq", {}).get("depth", 0) == 0, "a fenced primary's enqueues reached D"
    again = drgate("promote", "--config", config)
    assert again.returncode == 0 and "already promoted" in again.stdout

    # Failback, explicitly at both sites: D lets P in again at a new epoch and
    # is resynced to P's state; P resumes at that epoch, its guard lifted.
    accepted = drgate("failback", "--config", config, "--json")
    assert accepted.returncode == 0, accepted.stderr
    epoch = json.loads(accepted.stdout)["epoch"]
    assert epoch == result["epoch"] + 1
    p_config = str(two.p.workdir / "sidecar-1.yaml")
    resumed = drgate("failback", "--config", p_config, "--epoch", str(epoch), "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["superseded_by"] == "site-d"
    assert publish(two, "q-full", 10) == 10
    wait_for("D's full replica is P's again", lambda: converged(two))
    assert queues(two.d.describe(2))["q-full"]["depth"] == 210
    refused = two.d.client(1, "publish", two.d.amqp[1], "q-full", "--count", "1")
    assert "read-only" in (refused["error"] or refused["first_rejection"])


def test_new_incarnation_is_refused_until_accepted(two: TwoSites) -> None:
    assert publish(two, "q-full", 100) == 100
    assert publish(two, "q-enq", 100) == 100
    wait_for("D's full replica equals P's queue", lambda: converged(two))
    before = queues(two.d.describe(2))

    # What P takes while the WAN is down stays unsent in its sidecars' spools.
    two.wan_all("cut")
    last = {n: spool_last_seq(two, n) for n in two.nodes}
    assert publish(two, "q-full", 20) == 20
    assert publish(two, "q-enq", 20) == 20
    wait_for(
        "every P sidecar spooled the 40 unsent publishes",
        lambda: all(spool_last_seq(two, n) >= last[n] + 40 for n in two.nodes),
    )

    # P restarts from nothing: a new bus and empty brokers, a new incarnation.
    # Its sidecars keep their spools, as an operator's would: a spool of the
    # old incarnation (the 40 unsent events with it) is set aside at open,
    # never replayed.  The WAN's emulators restart with P, restored.
    two.p.stop()
    two.p.start()
    for n in two.nodes:
        two.start_wan(n)
    for n in two.nodes:
        two.start_sidecar(two.p, n)
    add_queues(two)
    assert publish(two, "q-full", 50) == 50
    assert publish(two, "q-enq", 30) == 30

    seen: dict[str, str] = {}

    def refused() -> bool:
        # Keep the text seen: the next attempt may end with another error.
        text = str(status(two, "site-p", 1)["last_error"])
        if "--accept-incarnation" in text:
            seen["error"] = text
        return "error" in seen

    wait_for("P's egress is refused with the accept command", refused)
    error = seen["error"]
    match = re.search(r"--accept-incarnation (\d+)", error)
    assert match is not None and "incarnation" in error
    after = queues(two.d.describe(2))
    assert after["q-full"]["digest"] == before["q-full"]["digest"], "D's replicas were touched"
    assert after["q-enq"]["depth"] == 100

    done = drgate(
        "resync",
        "--accept-incarnation",
        match.group(1),
        "--config",
        str(two.d.workdir / "sidecar-1.yaml"),
    )
    assert done.returncode == 0, done.stderr
    wait_for("D is re-seeded from the new incarnation", lambda: converged(two))
    d = queues(two.d.describe(3))
    assert d["q-full"]["depth"] == 50
    # D's enqueue queue keeps what its consumers have not taken, plus the new messages.
    wait_for(
        "D's enqueue queue got the new incarnation's messages",
        lambda: queues(two.d.describe(3))["q-enq"]["depth"] == 130,
    )
