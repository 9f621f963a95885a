"""A partition that leaves no side of a site with quorum (every node alone),
then heals: every member rejoins at the merge, so nobody holds the state and
no donor will come.  The site starts over from its brokers' journals and
states, as after a whole-site restart, and keeps every settled message
(found by the chaos run of seed 2025: a D site stuck for good, docs/chaos.md).

Corosync only: the embedded bus has no partitions.  Three corosync daemons in
network namespaces, a durable broker on each (lab.site.BrokerSite).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.netns import CorosyncSite
from lab.site import BrokerSite, SiteError, TwoSites
from tests.lab import converged, corosync_lab, queues, require_corosync, wait_for

pytestmark = [pytest.mark.corosync, pytest.mark.integration, pytest.mark.slow, pytest.mark.e2e]

QUEUE = "orders"
PROBE = "probe"
MINORITY = "is in a minority partition"
STARTED_OVER = "nobody in this member's view holds site site-d's state"


@pytest.fixture
def site(tmp_path: Path) -> Iterator[BrokerSite]:
    with (
        corosync_lab("nobodyquorate", subnet="10.213.42", prefix="dgQ") as lab,
        BrokerSite("site-d", backend="corosync", corosync=lab, workdir=tmp_path, durable=True) as s,
    ):
        for queue in (QUEUE, PROBE):
            done = s.admin(1, "add-queue", queue, "--durable")
            assert done.returncode == 0, done.stderr
        yield s


def log(site: BrokerSite, node: int) -> str:
    return (site.workdir / f"broker-{node}.log").read_text()


def depth(site: BrokerSite, node: int) -> int:
    return queues(site.describe(node))[QUEUE]["depth"]


def serves(site: BrokerSite, node: int) -> bool:
    """``node``'s broker settles a publish: it is in a quorate view and holds
    the state (one stuck waiting for a state transfer never settles it)."""
    try:
        got = site.client(node, "publish", site.amqp[node], PROBE, timeout=20)
    except (SiteError, subprocess.TimeoutExpired):
        return False
    return bool(got["accepted"] == 1)


def alone(site: BrokerSite, lab: CorosyncSite) -> None:
    """Every node cut off until each broker is alone without quorum; healed."""
    before = {n: log(site, n).count(MINORITY) for n in site.node_ids}  # a lone start says it too
    for n in site.node_ids:
        lab.cut(n)
    wait_for(
        "every broker is alone in a view without quorum",
        lambda: all(log(site, n).count(MINORITY) > before[n] for n in site.node_ids),
    )
    for n in site.node_ids:
        lab.restore(n)


def test_every_node_alone_then_the_merge_starts_the_site_over_and_keeps_what_was_settled(
    site: BrokerSite,
) -> None:
    got = site.client(1, "publish", site.amqp[1], QUEUE, "--count", "50", "--durable")
    assert got["accepted"] == 50, got
    wait_for("every broker holds the 50", lambda: all(depth(site, n) == 50 for n in site.node_ids))
    lab = site.corosync
    assert lab is not None
    alone(site, lab)
    for n in site.node_ids:
        wait_for(f"broker {n} serves the site again", lambda n=n: serves(site, n), timeout=120)
    assert any(STARTED_OVER in log(site, n) for n in site.node_ids)
    assert [depth(site, n) for n in site.node_ids] == [50, 50, 50]


def test_in_memory_the_site_starts_over_empty_as_a_new_incarnation_and_says_so(
    tmp_path: Path,
) -> None:
    with (
        corosync_lab("nobodyquorate", subnet="10.213.42", prefix="dgQ") as lab,
        BrokerSite("site-d", backend="corosync", corosync=lab, workdir=tmp_path) as site,
    ):
        assert site.admin(1, "add-queue", QUEUE).returncode == 0
        old = site.describe(1)["incarnation"]
        alone(site, lab)

        def new_incarnation(node: int) -> bool:
            described = site.describe(node)
            return described["incarnation"] not in (0, old) and QUEUE not in queues(described)

        for n in site.node_ids:
            wait_for(f"broker {n} runs a new, empty incarnation", lambda n=n: new_incarnation(n))
        assert any("in memory only: its state is lost" in log(site, n) for n in site.node_ids)
        assert len({site.describe(n)["incarnation"] for n in site.node_ids}) == 1


@pytest.mark.long  # two corosync sites: make test-long (the BrokerSite tests above run in CI)
def test_a_dr_site_that_started_over_resumes_the_link_and_ends_equal(tmp_path: Path) -> None:
    """The chaos run's case: D's sidecars run through the start-over too;
    the link resumes from what D's brokers recovered, and D ends equal to P
    with nothing lost."""
    require_corosync()
    with TwoSites(workdir=tmp_path, metrics=True, bus="corosync", durable=True) as two:
        for queue, mode in (("q-full", "full"), ("q-enq", "enqueue")):
            # Durable: a start-over keeps what a whole-site restart keeps.
            done = two.p.admin(1, "add-queue", queue, "--replicate", mode, "--durable")
            assert done.returncode == 0, done.stderr
        for queue in ("q-full", "q-enq"):
            got = two.p.client(1, "publish", two.p.amqp[1], queue, "--count", "50", "--durable")
            assert got["accepted"] == 50, got
        wait_for("D's full replica equals P's queue", lambda: converged(two))
        alone(two.d, two.labs[1])
        got = two.p.client(1, "publish", two.p.amqp[1], "q-full", "--count", "20", "--durable")
        assert got["accepted"] == 20, got
        wait_for("D's full replica equals P's again", lambda: converged(two), timeout=180)
        wait_for(
            "D's enqueue replica holds the 50",
            lambda: queues(two.d.describe(2)).get("q-enq", {}).get("depth") == 50,
        )
        assert any(STARTED_OVER in log(two.d, n) for n in two.nodes)
        assert queues(two.d.describe(2))["q-full"]["depth"] == 70
