"""The sites swap roles in place (docs/operations.md, "A planned switchover"):
with sidecar configs that link both ways, ``drgate switchover`` at P under
load makes D the primary and P its DR site without a resync, with RPO 0,
D's clients' changes reach P, and a second switchover under load, at D,
swaps them back with the same guarantees.  Two sites of three brokers and three sidecars
(lab.site.TwoSites, ``reversible``), on each bus."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.site import BrokerSite, TwoSites
from tests.gateway.test_promote import add_queues, drgate
from tests.gateway.test_switchover_e2e import outcomes
from tests.lab import queues, require_bus, status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(
    params=[
        pytest.param("embedded"),
        pytest.param("corosync", marks=pytest.mark.corosync),
    ]
)
def two(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TwoSites]:
    """Two sites whose sidecar configs link both ways, on each bus, with
    the queues of every mode declared at P."""
    require_bus(request.param)
    with TwoSites(workdir=tmp_path, metrics=True, reversible=True, bus=request.param) as sites:
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


def under_load(site: BrokerSite, config: Path, prefix: str) -> tuple[dict[str, Any], int]:
    """``drgate switchover --config CONFIG`` while a publisher at ``site``
    sends to q-full at 100 a second; its result, and how many of the
    publisher's messages ``site`` accepted (all before the first refusal)."""
    record = site.workdir / f"publisher-{prefix}.jsonl"
    publisher = site.client_popen(
        1, "publish", site.amqp[1], "q-full", "--count", "100000", "--rate", "100",
        "--prefix", prefix, "--record", str(record),
    )  # fmt: skip
    wait_for("the publisher is under way", lambda: len(outcomes(record)) > 50)
    result = switch_over(config)
    wait_for("publishes are refused", lambda: outcomes(record).count("rejected") >= 20)
    publisher.kill()
    publisher.communicate()
    seen = outcomes(record)
    assert "accepted" not in seen[seen.index("rejected") :]  # none after the first refusal
    print("switchover:", {k: result[k] for k in ("window_seconds", "drained_cseqs")})  # -s
    return result, seen.count("accepted")


def test_a_switchover_under_load_swaps_the_sites_and_a_second_one_swaps_them_back(
    two: TwoSites,
) -> None:
    p, d = two.p, two.d
    wait_for("the link is up", lambda: status(two, "site-p", 1)["link_state"] == "up")
    seeded = [status(two, "site-d", n)["resync"]["total"] for n in two.nodes]  # the seeding

    first, at_p = under_load(p, p.workdir / "sidecar-1.yaml", "p")
    assert first["switched"] and first["swapped"], first
    assert [s["step"] for s in first["steps"]][-2:] == ["swap", "done"]
    # RPO 0: D holds exactly what P accepted; P's copy is D's, nothing shipped.
    assert queues(p.describe(2))["q-full"]["depth"] == at_p
    assert same(p, d, "q-full")
    assert replica(p, "q-full") == {"origin": "site-d", "mode": "full"}
    assert replica(p, "q-enq") == {"origin": "site-d", "mode": "enqueue"}
    assert status(two, "site-d", 1)["role"] == "egress"
    assert status(two, "site-p", 1)["role"] == "ingress"
    assert status(two, "site-p", 1)["resync"]["total"] == 0
    # The DR site's commands run at P now, with P's config, and not at D.
    dry = drgate("promote", "--config", str(p.workdir / "sidecar-1.yaml"), "--dry-run", "--json")
    assert dry.returncode == 0 and json.loads(dry.stdout)["origin"] == "site-d", dry.stderr
    at_d = drgate("promote", "--config", str(d.workdir / "sidecar-1.yaml"), "--dry-run")
    assert at_d.returncode != 0 and "site-d is the primary now" in at_d.stderr, at_d.stderr

    # D's clients: a consumer and an enqueue publisher; P follows.
    taken = d.client(2, "consume", d.amqp[2], "q-full", "--count", "10")
    assert taken["received"] == 10
    enq = d.client(1, "publish", d.amqp[1], "q-enq", "--count", "5", "--prefix", "d")
    assert enq["accepted"] == 5
    wait_for(
        "P's enqueue replica received D's 5",
        lambda: queues(p.describe(2))["q-enq"]["depth"] == 5,
    )
    refused = p.client(1, "publish", p.amqp[1], "q-full", "--count", "1", "--prefix", "late")
    assert refused["accepted"] == 0  # P's full replica is read-only now

    second, at_d = under_load(d, d.workdir / "sidecar-1.yaml", "d")
    assert second["switched"] and second["swapped"], second
    # RPO 0 the other way: P holds everything D accepted, and its own.
    assert queues(p.describe(2))["q-full"]["depth"] == at_p - 10 + at_d
    assert same(p, d, "q-full")
    assert replica(d, "q-full") == {"origin": "site-p", "mode": "full"}
    assert status(two, "site-p", 1)["role"] == "egress"
    assert status(two, "site-d", 1)["role"] == "ingress"

    back = p.client(1, "publish", p.amqp[1], "q-full", "--count", "5", "--prefix", "back")
    assert back["accepted"] == 5
    wait_for("D's replica equals P's queue again", lambda: same(p, d, "q-full"))
    # No resync in either direction: only the seeding, at the start.
    assert [status(two, "site-d", n)["resync"]["total"] for n in two.nodes] == seeded
