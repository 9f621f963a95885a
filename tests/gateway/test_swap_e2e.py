"""The sites swap roles in place (docs/operations.md, "A planned switchover"):
with sidecar configs that link both ways, ``drgate switchover`` at P makes
D the primary and P its DR site without a resync, D's clients' messages
reach P, and a second switchover, at D, swaps them back with both sites'
messages kept.  Two sites of three brokers and three sidecars
(lab.site.TwoSites, ``reversible``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.site import BrokerSite, TwoSites
from tests.gateway.test_promote import add_queues, drgate
from tests.lab import queues, status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoSites]:
    with TwoSites(workdir=tmp_path, metrics=True, reversible=True) as sites:
        add_queues(sites)
        yield sites


def same(a: BrokerSite, b: BrokerSite, queue: str) -> bool:
    """``queue`` holds the same messages at broker 2 of both sites."""
    qa, qb = queues(a.describe(2)).get(queue), queues(b.describe(2)).get(queue)
    return qa is not None and qb is not None and qa["digest"] == qb["digest"]


def switch_over(config: Path) -> dict[str, Any]:
    done = drgate("switchover", "--config", str(config), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def replica(site: BrokerSite, queue: str) -> dict[str, Any] | None:
    found: dict[str, Any] | None = queues(site.describe(1))[queue]["replica"]
    return found


def test_a_switchover_swaps_the_sites_and_a_second_one_swaps_them_back(two: TwoSites) -> None:
    p, d = two.p, two.d
    assert (
        p.client(1, "publish", p.amqp[1], "q-full", "--count", "30", "--prefix", "p")["accepted"]
        == 30
    )
    wait_for("D's full replica equals P's queue", lambda: same(p, d, "q-full"))
    seeded = [status(two, "site-d", n)["resync"]["total"] for n in two.nodes]  # the seeding

    first = switch_over(p.workdir / "sidecar-1.yaml")
    assert first["switched"] and first["swapped"], first
    assert [s["step"] for s in first["steps"]][-2:] == ["swap", "done"]
    # P is D's DR site: its queues are replicas of D's, nothing was shipped.
    assert replica(p, "q-full") == {"origin": "site-d", "mode": "full"}
    assert replica(p, "q-enq") == {"origin": "site-d", "mode": "enqueue"}
    assert status(two, "site-d", 1)["role"] == "egress"
    assert status(two, "site-p", 1)["role"] == "ingress"
    assert status(two, "site-p", 1)["resync"]["total"] == 0

    # D's clients: publishes and a consumer; P follows.
    d_pub = d.client(1, "publish", d.amqp[1], "q-full", "--count", "20", "--prefix", "d")
    assert d_pub["accepted"] == 20
    taken = d.client(2, "consume", d.amqp[2], "q-full", "--count", "10")
    assert taken["received"] == 10
    assert (
        d.client(1, "publish", d.amqp[1], "q-enq", "--count", "5", "--prefix", "d")["accepted"] == 5
    )
    wait_for("P's replica equals D's queue", lambda: same(d, p, "q-full"))
    assert queues(p.describe(2))["q-full"]["depth"] == 40
    refused = p.client(1, "publish", p.amqp[1], "q-full", "--count", "1", "--prefix", "late")
    assert refused["accepted"] == 0  # P's full replica is read-only now

    second = switch_over(d.workdir / "sidecar-1.yaml")
    assert second["switched"] and second["swapped"], second
    assert replica(d, "q-full") == {"origin": "site-p", "mode": "full"}
    assert status(two, "site-p", 1)["role"] == "egress"
    assert status(two, "site-d", 1)["role"] == "ingress"

    assert (
        p.client(1, "publish", p.amqp[1], "q-full", "--count", "5", "--prefix", "back")["accepted"]
        == 5
    )
    wait_for("D's replica equals P's queue again", lambda: same(p, d, "q-full"))
    assert queues(d.describe(2))["q-full"]["depth"] == 45
    # No resync in either direction: only the seeding, at the start.
    assert [status(two, "site-d", n)["resync"]["total"] for n in two.nodes] == seeded
