"""Resync end to end: a DR site seeded from nothing, a WAN cut in the middle of
a resync, a rules switch that starts replicating a queue with messages on it.

Two sites of three brokers and three sidecars (deploy.lab.site.TwoSites),
Proton clients.  P is started first and loaded, then D's sidecars join: D
applied nothing of P's incarnation, so P's egress sends a snapshot cut at its
cseq, then the stream from the cut.  Nothing may be lost or applied twice:
per-queue digests of P and D are equal for ``full`` queues, and D's
``enqueue`` queue holds every id once, in order.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.lab.site import TwoSites, finish_client

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

DEADLINE_S = 60.0
MODES = {"q-full": "full", "q-enq": "enqueue", "q-wire": "wiring", "q-none": "none"}
LOADED = 10_000


def wait_for(what: str, check: Callable[[], bool], *, timeout: float = DEADLINE_S) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting until {what}")
        time.sleep(0.1)  # polling other processes: there is no event to await
    return time.monotonic() - start


def queues(described: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {q["name"]: q for q in described["queues"]}


def status(two: TwoSites, site: str, node: int) -> dict[str, Any]:
    port = two.metrics_port[(site, node)]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as reply:
        result: dict[str, Any] = json.load(reply)
        return result


def start_p_first(two: TwoSites) -> None:
    """P's brokers and sidecars, D's brokers and the WAN; no D sidecar yet."""
    two.p.start()
    two.d.start()
    for n in two.nodes:
        two.start_wan(n)
    for n in two.nodes:
        two.start_sidecar(two.p, n)


def start_d_sidecars(two: TwoSites) -> None:
    for n in two.nodes:
        two.start_sidecar(two.d, n)


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoSites]:
    sites = TwoSites(workdir=tmp_path, metrics=True)
    try:
        start_p_first(sites)
        for queue, mode in MODES.items():
            done = sites.p.admin(1, "add-queue", queue, "--replicate", mode)
            assert done.returncode == 0, done.stderr
        yield sites
    finally:
        sites.stop()


def publish(two: TwoSites, queue: str, count: int, *, start: int = 1) -> Any:
    return two.p.client_popen(
        1, "publish", two.p.amqp[1], queue, "--count", str(count), "--start", str(start)
    )


def load_p(two: TwoSites, count: int = LOADED) -> None:
    publishers = [publish(two, q, count) for q in ("q-full", "q-enq")]
    publishers.append(publish(two, "q-wire", 100))
    for p in publishers:
        assert finish_client(p)["accepted"] in (count, 100)


def digests_equal(two: TwoSites, queue: str) -> bool:
    p, d = queues(two.p.describe(2)), queues(two.d.describe(2))
    return queue in d and p[queue]["digest"] == d[queue]["digest"]


def check_enqueue(two: TwoSites, total: int) -> None:
    wait_for(
        "D's enqueue queue holds every message",
        lambda: queues(two.d.describe(2)).get("q-enq", {}).get("depth") == total,
    )
    got = two.d.client(
        2, "consume", two.d.amqp[2], "q-enq", "--count", str(total), "--idle", "5", "--credit",
        "500",
    )  # fmt: skip
    assert got["ids"] == [f"m-{i}" for i in range(1, total + 1)], "lost, doubled or reordered"


def test_empty_d_is_seeded_by_resync_while_p_takes_traffic(two: TwoSites) -> None:
    load_p(two)
    # P consumes some of its full queue: D's copy must not have them.
    taken = two.p.client(2, "consume", two.p.amqp[2], "q-full", "--count", "1000")
    assert taken["received"] == 1000
    live = [publish(two, q, 2000, start=LOADED + 1) for q in ("q-full", "q-enq")]
    started = time.monotonic()
    start_d_sidecars(two)
    for p in live:
        assert finish_client(p)["accepted"] == 2000
    took = wait_for("D's full replica equals P's queue", lambda: digests_equal(two, "q-full"))
    print(f"resync of {2 * LOADED} messages and catch-up: {time.monotonic() - started:.1f} s")
    d = queues(two.d.describe(3))
    assert d["q-full"]["depth"] == LOADED + 2000 - 1000
    assert d["q-wire"]["depth"] == 0 and d["q-wire"]["replica"]["mode"] == "wiring"
    assert "q-none" not in d
    egress = status(two, "site-p", 1)
    assert egress["resync"]["total"] >= 1
    assert egress["resync"]["bytes_total"] > 0
    check_enqueue(two, LOADED + 2000)
    # Normal streaming after the resync.
    assert finish_client(publish(two, "q-full", 100, start=LOADED + 2001))["accepted"] == 100
    wait_for("the stream after the resync reaches D", lambda: digests_equal(two, "q-full"))
    assert took < DEADLINE_S


def test_wan_cut_during_a_resync_restarts_it(two: TwoSites) -> None:
    load_p(two)
    for n in two.nodes:  # slow enough to cut the resync in the middle
        two.wan(n, "set rate_bps=40000 dir=up")
    start_d_sidecars(two)

    def midway() -> bool:
        resync = status(two, "site-d", 1)["resync"]
        return bool(resync["active"]) and 0 < resync["progress_ratio"] < 1

    wait_for("D's ingress is in the middle of a resync", midway)
    for n in two.nodes:
        two.wan(n, "cut")
    # Nothing of the interrupted resync was applied at D.
    assert "q-full" not in queues(two.d.describe(1))
    for n in two.nodes:
        two.wan(n, "set rate_bps=0 dir=up")
        two.wan(n, "restore")
    wait_for("D's full replica equals P's queue", lambda: digests_equal(two, "q-full"))
    assert status(two, "site-d", 1)["resync"]["total"] >= 2
    check_enqueue(two, LOADED)


def test_rules_switch_none_to_full_brings_existing_messages(two: TwoSites) -> None:
    # q-none holds 1,000 messages; re-declaring it with qpid.replicate=all
    # switches it to full at that cseq.
    start_d_sidecars(two)
    assert finish_client(publish(two, "q-none", 1000))["accepted"] == 1000
    wait_for("the link is up", lambda: status(two, "site-p", 1)["link_state"] == "up")
    assert "q-none" not in queues(two.d.describe(1))
    done = two.p.admin(1, "add-queue", "q-none", "--replicate", "full")
    assert done.returncode == 0, done.stderr
    assert finish_client(publish(two, "q-none", 500, start=1001))["accepted"] == 500
    wait_for("D's copy of q-none equals P's", lambda: digests_equal(two, "q-none"))
    d = queues(two.d.describe(2))
    assert d["q-none"]["depth"] == 1500
    assert d["q-none"]["replica"]["mode"] == "full"
