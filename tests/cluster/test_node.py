"""Broker nodes on a real bus, driven by Proton's own AMQP 1.0 client.

Each test runs on the embedded bus and on three (or four) corosync daemons in
network namespaces.  Brokers and clients are separate processes, started and
stopped by pid (lab/site.py).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lab.site import BrokerSite, finish_client
from tests.lab import BACKENDS, corosync_lab

DEADLINE_S = 120.0


@pytest.fixture(params=BACKENDS)
def site(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[BrokerSite]:
    if request.param == "corosync":
        with (
            corosync_lab("nodetest", subnet="10.213.8", prefix="dgN", nodes=4) as lab,
            BrokerSite("site-p", nodes=3, backend="corosync", corosync=lab, workdir=tmp_path) as s,
        ):
            yield s
    else:
        with BrokerSite("site-p", nodes=3, workdir=tmp_path) as s:
            yield s


def wait_for(what: str, check: Callable[[], bool], *, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.2)  # polling another process's state: there is no event to await


def digests(site: BrokerSite, nodes: list[int]) -> dict[int, str]:
    return {n: site.describe(n)["digest"] for n in nodes}


def queue_of(described: dict[str, Any], name: str) -> dict[str, Any]:
    return next(q for q in described["queues"] if q["name"] == name)


def test_publish_on_one_node_consume_on_another_exactly_once(site: BrokerSite) -> None:
    assert site.admin(1, "add-queue", "orders", "--replicate", "full").returncode == 0
    # 10,000 on the embedded bus; 2,000 on corosync, whose ring in the lab's
    # network namespaces carried about 150 a second here (CI's budget; the
    # rate itself is measured in bench/).
    total = 10_000 if site.backend == "embedded" else 2_000
    publisher = site.client_popen(1, "publish", site.amqp[1], "orders", "--count", str(total))
    consumer = site.client_popen(
        2, "consume", site.amqp[2], "orders", "--count", str(total), "--idle", "30"
    )
    published = finish_client(publisher)
    consumed = finish_client(consumer)
    assert published["accepted"] == total, published
    assert consumed["error"] == ""
    assert consumed["received"] == total
    assert sorted(consumed["ids"]) == sorted(f"m-{i}" for i in range(1, total + 1))
    # One producer, one consumer: FIFO order is kept end to end.
    assert consumed["ids"] == [f"m-{i}" for i in range(1, total + 1)]
    wait_for(
        "all nodes hold the same state", lambda: len(set(digests(site, [1, 2, 3]).values())) == 1
    )
    assert queue_of(site.describe(3), "orders")["depth"] == 0


def test_killed_node_releases_what_its_consumer_held(site: BrokerSite) -> None:
    assert site.admin(1, "add-queue", "jobs").returncode == 0
    assert site.client(1, "publish", site.amqp[1], "jobs", "--count", "500")["accepted"] == 500
    holder = site.client_popen(
        3, "consume", site.amqp[3], "jobs", "--hold", "--credit", "50", "--idle", "120"
    )
    try:
        wait_for(
            "the holder has 50 messages acquired",
            lambda: queue_of(site.describe(1), "jobs")["acquired"] == 50,
        )
        site.kill("broker-3", signal.SIGKILL)
        wait_for(
            "the killed node's messages are released",
            lambda: queue_of(site.describe(1), "jobs")["acquired"] == 0,
        )
    finally:
        holder.kill()
        holder.communicate()
    consumed = site.client(2, "consume", site.amqp[2], "jobs", "--count", "500", "--idle", "10")
    assert consumed["received"] == 500
    assert sorted(consumed["ids"]) == sorted(f"m-{i}" for i in range(1, 501))
    assert consumed["redelivered"] == 50


def test_node_started_mid_stream_gets_the_same_state(site: BrokerSite) -> None:
    assert site.admin(1, "add-queue", "events", "--replicate", "enqueue").returncode == 0
    publisher = site.client_popen(1, "publish", site.amqp[1], "events", "--count", "3000")
    site.node_ids.append(4)
    site.start_broker(4)
    assert finish_client(publisher)["accepted"] == 3000
    wait_for(
        "four nodes hold the same state",
        lambda: len(set(digests(site, [1, 2, 3, 4]).values())) == 1,
    )
    assert queue_of(site.describe(4), "events")["depth"] == 3000


# The refusals are the broker's, not the bus's: on corosync with make test-long.
@pytest.mark.parametrize(
    "site",
    [BACKENDS[0], pytest.param("corosync", marks=[*BACKENDS[1].marks, pytest.mark.long])],
    indirect=True,
)
def test_refusals_name_the_queue(site: BrokerSite) -> None:
    assert site.admin(1, "add-queue", "small", "--max-depth", "5").returncode == 0
    result = site.client(1, "publish", site.amqp[1], "small", "--count", "8")
    assert result["accepted"] == 5
    assert result["rejected"] == 3
    assert "small" in result["first_rejection"]
    missing = site.client(2, "consume", site.amqp[2], "nowhere", "--idle", "2")
    assert "nowhere" in missing["error"]
    assert "not-found" in missing["error"]
