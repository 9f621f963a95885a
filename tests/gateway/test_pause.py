"""``drgate replicate pause|resume QUEUE`` on two running sites: while a
queue is paused D's copy stays as it was and ``/status`` lists it; on resume
D gets what it lacks (the full replica equals P's queue again, the enqueue
copy gets the messages P still holds), without a failover or a restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.site import TwoSites
from tests.lab import converged, queues, status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

MODES = {"q-full": "full", "q-enq": "enqueue"}


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoSites]:
    with TwoSites(workdir=tmp_path, metrics=True) as sites:
        for queue, mode in MODES.items():
            done = sites.p.admin(1, "add-queue", queue, "--replicate", mode)
            assert done.returncode == 0, done.stderr
        yield sites


def publish(two: TwoSites, queue: str, count: int, start: int) -> None:
    sent = two.p.client(1, "publish", two.p.amqp[1], queue, "--count", str(count),
                        "--start", str(start))  # fmt: skip
    assert sent["accepted"] == count, sent


def depth_at_d(two: TwoSites, queue: str) -> int:
    depth: int = queues(two.d.describe(2)).get(queue, {}).get("depth", 0)
    return depth


def replicate(two: TwoSites, *args: str) -> str:
    done = two.p.drgate(1, "replicate", *args, "--broker", two.p.amqp[1])
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_paused_queue_keeps_ds_copy_and_resume_brings_it_up_to_date(two: TwoSites) -> None:
    for queue in MODES:
        publish(two, queue, 10, 1)
    wait_for("D holds the first ten", lambda: converged(two) and depth_at_d(two, "q-enq") == 10)
    for queue in MODES:
        assert "forward nothing" in replicate(two, "pause", queue)
    wait_for(
        "every P sidecar lists both paused",
        lambda: all(status(two, "site-p", n)["paused_queues"] == sorted(MODES) for n in two.nodes),
    )
    for queue in MODES:
        publish(two, queue, 10, 11)
    taken = two.p.client(2, "consume", two.p.amqp[2], "q-full", "--count", "5")
    assert taken["received"] == 5
    # A marker on a queue that was never paused goes through the same link:
    # once D has it, D has everything forwarded before it.
    assert two.p.admin(1, "add-queue", "q-marker", "--replicate", "full").returncode == 0
    publish(two, "q-marker", 1, 1)
    wait_for("the marker is at D", lambda: converged(two, queue="q-marker"))
    assert depth_at_d(two, "q-full") == 10  # stale, as paused
    assert depth_at_d(two, "q-enq") == 10

    for queue in MODES:
        assert "D gets what it lacks" in replicate(two, "resume", queue)
    wait_for("D's full replica equals P's queue again", lambda: converged(two))
    wait_for("D's enqueue copy has all twenty", lambda: depth_at_d(two, "q-enq") == 20)
    got = two.d.client(2, "consume", two.d.amqp[2], "q-enq", "--idle", "3")
    assert got["ids"] == [f"m-{i}" for i in range(1, 21)]  # once each, in order
    assert all(status(two, "site-p", n)["paused_queues"] == [] for n in two.nodes)
