"""Resync under faults: every P spool overflowed while D was down; the active
egress killed in the middle of a resync.  Two sites on the embedded bus, and
on corosync in network namespaces (kills are view changes)."""

from __future__ import annotations

import functools
import signal
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
MODES = {"q-full": "full", "q-enq": "enqueue", "q-wire": "wiring"}
# Small enough that a few thousand events overflow it (segments of 32 KiB).
SPOOL_BYTES = 256 * 1024


def publish(two: TwoSites, queue: str, count: int, start: int = 1) -> Any:
    return two.p.client_popen(
        1, "publish", two.p.amqp[1], queue, "--count", str(count), "--start", str(start)
    )


@pytest.fixture(params=BUSES)
def two(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TwoSites]:
    require_bus(request.param)
    with TwoSites(
        workdir=tmp_path, metrics=True, spool_max_bytes=SPOOL_BYTES, bus=request.param
    ) as sites:
        for queue, mode in MODES.items():
            done = sites.p.admin(1, "add-queue", queue, "--replicate", mode)
            assert done.returncode == 0, done.stderr
        yield sites


def test_d_down_while_every_spool_overflowed_is_resynced_without_redelivery(
    two: TwoSites,
) -> None:
    # D's consumers take the first 300 messages of the enqueue queue.
    assert finish_client(publish(two, "q-enq", 300))["accepted"] == 300
    taken = two.d.client(2, "consume", two.d.amqp[2], "q-enq", "--count", "300", "--idle", "30")
    assert taken["ids"] == [f"m-{i}" for i in range(1, 301)]
    # D's sidecars go down; P goes on until every spool has overflowed.
    for n in two.nodes:
        two.d.kill(f"sidecar-{n}", signal.SIGKILL)
    more = [publish(two, q, 3000, start=301) for q in ("q-enq", "q-full")]
    for publisher in more:
        assert finish_client(publisher)["accepted"] == 3000
    for n in two.nodes:
        wait_for(
            f"P sidecar {n}'s spool overflowed",
            lambda n=n: status(two, "site-p", n)["spool"]["needs_resync"] is True,
        )
    two.start_d_sidecars()
    wait_for("D's full replica equals P's queue after the resync", lambda: converged(two))
    assert status(two, "site-p", 1)["resync"]["total"] >= 1
    got = two.d.client(2, "consume", two.d.amqp[2], "q-enq", "--count", "3000", "--idle", "10")
    # Only what D had not received: nothing its consumers took comes back.
    assert got["ids"] == [f"m-{i}" for i in range(301, 3301)]


def test_active_egress_killed_mid_resync_restarts_it_on_the_standby(two: TwoSites) -> None:
    wait_for("D holds P's queues", lambda: set(MODES) <= set(queues(two.d.describe(1))))
    for n in two.nodes:
        two.d.kill(f"sidecar-{n}", signal.SIGKILL)
    for publisher in [publish(two, q, 3000) for q in ("q-enq", "q-full")]:
        assert finish_client(publisher)["accepted"] == 3000
    for n in two.nodes:  # slow enough to catch the resync in the middle
        two.wan(n, "set rate_bps=4000 dir=up")
    two.start_d_sidecars()

    def midway() -> bool:
        # D's ingress counts the chunks it has; P's egress hears of them only
        # with the acks, at the end.
        resync = status(two, "site-d", 1)["resync"]
        return bool(resync["active"]) and resync["progress_ratio"] < 1

    wait_for("the egress is in the middle of a resync", midway)
    two.p.kill("sidecar-1", signal.SIGKILL)
    # D had the queues (declared before its sidecars went down) and nothing
    # of the resync cut short is applied.
    assert queues(two.d.describe(1))["q-full"]["depth"] == 0, "a cut resync must apply nothing"
    for n in two.nodes:
        two.wan(n, "set rate_bps=0 dir=up")
    wait_for("the standby resynced D", lambda: converged(two))
    assert status(two, "site-p", 2)["role"] == "egress"
    got = two.d.client(2, "consume", two.d.amqp[2], "q-enq", "--count", "3000", "--idle", "10")
    assert got["ids"] == [f"m-{i}" for i in range(1, 3001)]
