"""Two sites end to end: brokers, sidecars, the WAN emulator, Proton clients.

Site P and site D have three brokers and three sidecars each, on the embedded
bus; P's sidecars reach D's through one WAN emulator per D sidecar.  Queues in
all four modes at once.  After each scenario the invariants hold:

* each ``full`` replica at D holds exactly P's messages in P's order (equal
  per-queue digests);
* each ``enqueue`` queue at D received every message once, in order;
* ``wiring`` queues exist at D and are empty; ``none`` queues do not exist.
"""

from __future__ import annotations

import functools
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.site import TwoSites, finish_client
from tests import lab
from tests.lab import BUSES, converged, queues, require_bus, status

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

DEADLINE_S = 120.0
wait_for = functools.partial(lab.wait_for, timeout=DEADLINE_S)
MODES = {"q-full": "full", "q-enq": "enqueue", "q-wire": "wiring", "q-none": "none"}


def _two_sites(tmp_path: Path, bus: str) -> Iterator[TwoSites]:
    with TwoSites(workdir=tmp_path, metrics=True, bus=bus) as sites:
        for queue, mode in MODES.items():
            done = sites.p.admin(1, "add-queue", queue, "--replicate", mode)
            assert done.returncode == 0, done.stderr
        yield sites
    for corosync in sites.labs:
        assert corosync.leftovers() == []


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoSites]:
    """Two sites on the embedded bus."""
    yield from _two_sites(tmp_path, "embedded")


@pytest.fixture(params=BUSES)
def two_any(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TwoSites]:
    """Two sites on either bus: the scenarios that test view changes run on
    corosync in network namespaces too."""
    require_bus(request.param)
    yield from _two_sites(tmp_path, request.param)


def depth_at_p(two: TwoSites, queue: str) -> int:
    depth: int = queues(two.p.describe(2))[queue]["depth"]
    return depth


def check_invariants(two: TwoSites, published: int, *, d_node: int = 2) -> None:
    wait_for("D's full replica equals P's queue", lambda: converged(two, d_node))
    d = queues(two.d.describe(d_node))
    assert d["q-wire"]["depth"] == 0
    assert "q-none" not in d
    assert d["q-full"]["replica"]["mode"] == "full"
    wait_for(
        "D's enqueue queue holds every message",
        lambda: queues(two.d.describe(d_node))["q-enq"]["depth"] == published,
    )
    got = two.d.client(
        d_node, "consume", two.d.amqp[d_node], "q-enq", "--count", str(published), "--idle", "5"
    )
    assert got["ids"] == [f"m-{i}" for i in range(1, published + 1)], "lost, doubled or reordered"


def publish_all(two: TwoSites, count: int, node: int = 1) -> list[Any]:
    return [
        two.p.client_popen(node, "publish", two.p.amqp[node], queue, "--count", str(count))
        for queue in MODES
    ]


def finish(publishers: list[Any], count: int) -> None:
    for publisher in publishers:
        assert finish_client(publisher)["accepted"] == count


def test_every_mode_reaches_d_as_configured(two: TwoSites) -> None:
    d_consumer = two.d.client_popen(
        2, "consume", two.d.amqp[2], "q-enq", "--count", "1000", "--idle", "60"
    )
    publishers = publish_all(two, 1000)
    p_consumer = two.p.client(2, "consume", two.p.amqp[2], "q-full", "--count", "400")
    finish(publishers, 1000)
    assert p_consumer["received"] == 400
    consumed_at_d = finish_client(d_consumer)
    assert consumed_at_d["ids"] == [f"m-{i}" for i in range(1, 1001)]
    wait_for("D's full replica equals P's queue", lambda: converged(two))
    d = queues(two.d.describe(3))
    assert d["q-full"]["depth"] == 600
    assert d["q-enq"]["depth"] == 0
    assert d["q-wire"]["depth"] == 0
    assert "q-none" not in d
    p_status = status(two, "site-p", 1)
    assert p_status["role"] == "egress"
    assert status(two, "site-d", 1)["role"] == "ingress"
    wait_for("the lag falls to zero", lambda: status(two, "site-p", 1)["lag_events"] == 0)
    # A comparison asked for now: D's replicas equal P's queues at its point.
    d_urls = [f"--url={two.status_url('site-d', n)}" for n in two.nodes]
    p_config = str(two.p.workdir / "sidecar-1.yaml")
    done = two.p.drgate(1, "verify", "--config", p_config, *d_urls, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout.splitlines()
    assert said[0].startswith("verification point at cseq ")
    verdict = json.loads(said[-1])
    assert verdict["differ"] == [] and verdict["late"] == []
    assert sorted(verdict["queues"]) == ["q-enq", "q-full"]
    assert all(r["origin_cseq"] >= verdict["cseq"] > 0 for r in verdict["queues"].values())


def test_full_replica_is_read_only_at_d(two: TwoSites) -> None:
    finish(publish_all(two, 10), 10)
    wait_for("D's full replica equals P's queue", lambda: converged(two))
    published = two.d.client(1, "publish", two.d.amqp[1], "q-full", "--count", "1")
    refusal = published["error"] or published["first_rejection"]
    assert "read-only replica" in refusal
    assert "promote" in refusal
    consumed = two.d.client(1, "consume", two.d.amqp[1], "q-full", "--idle", "2")
    assert "read-only replica" in consumed["error"]


def test_wan_cut_for_five_seconds(two_any: TwoSites) -> None:
    publishers = publish_all(two_any, 1500)
    wait_for("P is mid-stream", lambda: depth_at_p(two_any, "q-enq") >= 500)
    for n in two_any.nodes:
        two_any.wan(n, "cut")
    time.sleep(5)  # the scenario: the WAN is down for five seconds
    for n in two_any.nodes:
        two_any.wan(n, "restore")
    finish(publishers, 1500)
    check_invariants(two_any, 1500)


@pytest.mark.parametrize(("site", "role"), [("p", "egress"), ("d", "ingress")])
def test_active_sidecar_killed(two_any: TwoSites, site: str, role: str) -> None:
    publishers = publish_all(two_any, 1500)
    wait_for("P is mid-stream", lambda: depth_at_p(two_any, "q-enq") >= 500)
    getattr(two_any, site).kill("sidecar-1", signal.SIGKILL)
    took = wait_for(
        f"a standby takes over the {role}",
        lambda: (
            status(two_any, f"site-{site}", 2)["role"] == role
            and status(two_any, f"site-{site}", 2)["link_state"] == "up"
        ),
    )
    print(f"{role} takeover after SIGKILL: {took:.2f} s")
    finish(publishers, 1500)
    check_invariants(two_any, 1500)


def test_broker_on_the_egress_node_killed(two_any: TwoSites) -> None:
    publishers = publish_all(two_any, 2000, node=2)
    wait_for("P is mid-stream", lambda: depth_at_p(two_any, "q-enq") >= 500)
    two_any.p.kill("broker-1", signal.SIGKILL)
    finish(publishers, 2000)
    check_invariants(two_any, 2000)


def test_d_sidecar_started_empty_takes_part_in_failover(two_any: TwoSites) -> None:
    publishers = publish_all(two_any, 1500)
    wait_for("P is mid-stream", lambda: depth_at_p(two_any, "q-enq") >= 500)
    two_any.d.kill("sidecar-3", signal.SIGKILL)
    spool = two_any.d.workdir / "spool-3"
    for path in spool.glob("*"):
        path.unlink()
    two_any.start_sidecar(two_any.d, 3)  # empty: it joins by state transfer
    two_any.d.kill("sidecar-1", signal.SIGKILL)
    two_any.d.kill("sidecar-2", signal.SIGKILL)
    wait_for(
        "the new sidecar is the active ingress",
        lambda: (
            status(two_any, "site-d", 3)["role"] == "ingress"
            and status(two_any, "site-d", 3)["link_state"] == "up"
        ),
    )
    finish(publishers, 1500)
    check_invariants(two_any, 1500)
