"""What the operator sees around a failover, end to end (lab.site.TwoSites,
embedded bus, one node per site): a split brain parks both sites and says so,
and D's recovery point is scraped from D's /metrics while P is gone."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.site import ROOT, TwoSites, drgate_argv, finish_client
from tests.lab import metric, queues, status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]


def drgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        drgate_argv(*args), capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )


def publish(site: Any, queue: str, count: int) -> int:
    popen = site.client_popen(1, "publish", site.amqp[1], queue, "--count", str(count))
    accepted: int = finish_client(popen)["accepted"]
    return accepted


def depths(site: Any) -> dict[str, int]:
    return {name: q["depth"] for name, q in queues(site.describe(1)).items()}


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoSites]:
    with TwoSites(workdir=tmp_path, metrics=True, nodes=1) as sites:
        done = sites.p.admin(1, "add-queue", "q-full", "--replicate", "full")
        assert done.returncode == 0, done.stderr
        assert publish(sites.p, "q-full", 20) == 20
        wait_for("D holds P's 20 messages", lambda: depths(sites.d).get("q-full") == 20)
        yield sites


def test_a_link_between_two_primaries_parks_both_and_merges_nothing(two: TwoSites) -> None:
    two.wan_all("cut")
    promoted = drgate("promote", "--config", str(two.d.workdir / "sidecar-1.yaml"))
    assert promoted.returncode == 0, promoted.stderr
    assert publish(two.d, "q-full", 5) == 5  # D takes writes as a primary
    assert publish(two.p, "q-full", 3) == 3  # and so does P, cut off: two primaries
    p_before, d_before = depths(two.p), depths(two.d)
    assert (p_before["q-full"], d_before["q-full"]) == (23, 25)

    two.wan_all("restore")
    wait_for("P's egress parks", lambda: status(two, "site-p", 1)["partitioned"] is True)
    wait_for("D's ingress parks", lambda: status(two, "site-d", 1)["partitioned"] is True)
    for cluster in ("site-p", "site-d"):
        doc = status(two, cluster, 1)
        assert "split brain" in doc["last_error"], doc["last_error"]
        assert "drgate failback --config" in doc["last_error"], doc["last_error"]
        assert metric(two, cluster, "drgate_partitioned") == 1
    p_status = status(two, "site-p", 1)
    assert p_status["link_state"] == "refused"  # docs/observability.md
    assert p_status["superseded_by"] == "site-d"
    tried = metric(two, "site-p", "drgate_link_reconnects_total") or 0
    wait_for(
        "the refused egress tries twice more",
        lambda: (metric(two, "site-p", "drgate_link_reconnects_total") or 0) >= tried + 2,
        timeout=30,
    )
    assert (depths(two.p), depths(two.d)) == (p_before, d_before), "something was merged"


def test_with_p_killed_ds_recovery_point_rises_with_wall_time(two: TwoSites) -> None:
    # Idle P: its heartbeats keep D's recovery point within a ping interval.
    quiet_since = time.monotonic()
    wait_for(
        "more than a ping interval passes with nothing published",
        lambda: time.monotonic() - quiet_since > 7,
        timeout=30,
    )
    idle = metric(two, "site-d", "drgate_rpo_seconds")
    assert idle is not None and idle <= 7.0, idle
    assert metric(two, "site-d", "drgate_rpo_events") == 0
    assert status(two, "site-d", 1)["rpo_seconds"] is not None

    two.p.kill("sidecar-1")
    two.p.kill("broker-1")
    first_at, first = time.monotonic(), metric(two, "site-d", "drgate_rpo_seconds")
    assert first is not None
    wait_for(
        "D's recovery point rises while P is gone",
        lambda: (metric(two, "site-d", "drgate_rpo_seconds") or 0) >= first + 3,
        timeout=30,
    )
    later_at, later = time.monotonic(), metric(two, "site-d", "drgate_rpo_seconds")
    assert later is not None
    assert later - first == pytest.approx(later_at - first_at, abs=0.5)
    assert later > idle


def test_a_restarted_ingress_and_the_active_one_agree_within_seconds(tmp_path: Path) -> None:
    """D's sidecar 1 killed: sidecar 2 takes the link.  Restarted, sidecar 1
    is a standby (the active sidecar is the one ready longest), and the three
    D sidecars' /status agree within seconds: one ingress, whose link is up,
    at the applied point P's egress reports acked."""
    with TwoSites(workdir=tmp_path, metrics=True) as two:
        done = two.p.admin(1, "add-queue", "q-full", "--replicate", "full")
        assert done.returncode == 0, done.stderr
        two.d.kill("sidecar-1")
        wait_for("sidecar 2 has the link", lambda: status(two, "site-d", 2)["link_state"] == "up")
        assert publish(two.p, "q-full", 10) == 10
        two.start_sidecar(two.d, 1)

        def agree() -> bool:
            docs = [status(two, "site-d", n) for n in (1, 2, 3)]
            roles = [(d["role"], d["link_state"]) for d in docs]
            egress = status(two, "site-p", 1)
            applied = {d["resync"].get("epoch") for d in docs}
            return (
                roles
                == [("ingress-standby", "down"), ("ingress", "up"), ("ingress-standby", "down")]
                and egress["link_state"] == "up"
                and egress["acked_seq"] == egress["last_seq"]
                and len(applied) == 1
            )

        wait_for("the D sidecars' status agrees", agree, timeout=15)

        def p_converged(n: int) -> bool:
            doc = status(two, "site-p", n)
            return doc["lag_events"] == 0 and doc["acked_seq"] == doc["last_seq"]

        # P's standbys trim by the egress's last watermark too: no lag left.
        for n in (1, 2, 3):
            wait_for(f"P sidecar {n} reports no lag", lambda n=n: p_converged(n), timeout=10)
