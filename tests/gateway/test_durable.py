"""Durable brokers end to end: every process of P killed while publishers
publish, then started again on the same directories.  The brokers recover
from their journals, agree on the most advanced one, keep the incarnation
and the cseq numbering, and D resumes the link on its own: no
``--accept-incarnation``, nothing settled missing at P, nothing applied twice
at D.  Transient state (a non-durable queue, transient messages on a durable
queue) is gone after the recovery, at P and, by the resync the recovery
forces, at D.  Two sites of three brokers and three sidecars
(lab.site.TwoSites, ``durable=True``)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.site import TwoSites, finish_client
from tests import lab
from tests.lab import converged, queues, status

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

MODES = {"q-full": "full", "q-enq": "enqueue"}
# Transient state, replicated in full: a non-durable queue, and a durable
# queue that gets transient messages only.
TRANSIENT = {"q-temp": (), "q-mixed": ("--durable",)}
LOAD = 4000  # per queue: long enough to be killed in the middle


@pytest.fixture(params=lab.BUSES)
def two(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TwoSites]:
    lab.require_bus(request.param)
    with TwoSites(workdir=tmp_path, metrics=True, bus=request.param, durable=True) as sites:
        for queue, mode in MODES.items():
            done = sites.p.admin(1, "add-queue", queue, "--replicate", mode, "--durable")
            assert done.returncode == 0, done.stderr
        for queue, options in TRANSIENT.items():
            done = sites.p.admin(1, "add-queue", queue, "--replicate", "full", *options)
            assert done.returncode == 0, done.stderr
        yield sites


def kill_primary_site(two: TwoSites) -> None:
    names = [f"sidecar-{n}" for n in two.nodes] + [f"broker-{n}" for n in two.nodes]
    if two.p.backend == "embedded":
        names.append("bus")
    for name in names:
        two.p.kill(name, signal.SIGKILL)


def consume_all(site: Any, node: int, queue: str) -> list[str]:
    got = site.client(node, "consume", site.amqp[node], queue, "--idle", "5", "--credit", "500")
    ids: list[str] = got["ids"]
    return ids


def test_primary_killed_whole_while_publishing_recovers_all_it_settled(two: TwoSites) -> None:
    for queue in TRANSIENT:  # transient messages, at D before the power cut
        sent = two.p.client(1, "publish", two.p.amqp[1], queue, "--count", "20")
        assert sent["accepted"] == 20
    for queue in TRANSIENT:
        lab.wait_for(
            f"D holds {queue}'s transient messages",
            lambda queue=queue: converged(two, queue=queue),  # type: ignore[misc]
        )
    publishers = {
        q: two.p.client_popen(1, "publish", two.p.amqp[1], q, "--count", str(LOAD), "--durable")
        for q in MODES
    }
    lab.wait_for(
        "P took part of the load",
        lambda: queues(two.p.describe(2)).get("q-enq", {}).get("depth", 0) >= LOAD // 4,
    )
    kill_primary_site(two)
    settled = {q: int(finish_client(p)["accepted"]) for q, p in publishers.items()}
    assert all(0 < n < LOAD for n in settled.values()), settled

    two.p.start()  # the same directories: every broker recovers its journal
    for n in two.nodes:
        two.start_sidecar(two.p, n)
    lab.wait_for("D's full replica equals P's queue", lambda: converged(two), timeout=120)
    for n in two.nodes:
        assert "--accept-incarnation" not in str(status(two, "site-p", n)["last_error"])

    at_p = queues(two.p.describe(2))
    for queue, count in settled.items():
        assert at_p[queue]["depth"] >= count, f"settled messages of {queue} were lost at P"
    # Transient state is gone: at P, and at D by the resync the recovery forced.
    assert "q-temp" not in at_p and at_p["q-mixed"]["depth"] == 0
    lab.wait_for(
        "D dropped the transient state P dropped",
        lambda: (
            queues(two.d.describe(2)).get("q-temp", {}).get("depth", 0) == 0
            and queues(two.d.describe(2))["q-mixed"]["depth"] == 0
        ),
        timeout=60,
    )
    # D's enqueue copy: every message P holds, once, in order (R1 stayed exact).
    p_ids = consume_all(two.p, 2, "q-enq")
    lab.wait_for(
        "D's enqueue queue holds what P recovered",
        lambda: queues(two.d.describe(2))["q-enq"]["depth"] == len(p_ids),
        timeout=60,
    )
    d_ids = consume_all(two.d, 2, "q-enq")
    assert d_ids == p_ids, "D lost, doubled or reordered what P recovered"
    assert p_ids[: settled["q-enq"]] == [f"m-{i}" for i in range(1, settled["q-enq"] + 1)]
    # And the site goes on: new publishes reach D.
    more = two.p.client(
        1, "publish", two.p.amqp[1], "q-full", "--count", "50", "--start", "9001", "--durable"
    )
    assert more["accepted"] == 50
    lab.wait_for("the stream after the recovery reaches D", lambda: converged(two))
