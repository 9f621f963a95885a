"""Durable brokers end to end: every process of P (or of D) killed while
publishers publish, then started again on the same directories.  The
brokers recover from their journals, agree on the most advanced one, keep
the incarnation and the cseq numbering, and D resumes the link on its own:
no ``--accept-incarnation``, nothing settled missing at P, nothing applied
twice at D.  D acks only what is on a D broker's disk, so after D's own
power loss the link resumes from D's journaled watermarks and P resends
from its spool what D had not acked: no resync.  Transient state (a
non-durable queue, transient messages on a durable queue) is gone after P's
recovery, at P and, by the resync the recovery forces, at D.  Two sites of
three brokers and three sidecars (lab.site.TwoSites, ``durable=True``)."""

from __future__ import annotations

import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.site import BrokerSite, TwoSites, finish_client
from tests import lab
from tests.lab import converged, queues, status

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

MODES = {"q-full": "full", "q-enq": "enqueue"}
# Transient state, replicated in full: a non-durable queue, and a durable
# queue that gets transient messages only.
TRANSIENT = {"q-temp": (), "q-mixed": ("--durable",)}


def load(two: TwoSites) -> int:
    """Messages a queue: long enough to be killed in the middle (corosync's
    lab ring carries fewer a second, so fewer do)."""
    return 4000 if two.bus == "embedded" else 1500


@pytest.fixture(params=lab.WHOLE_SITE_BUSES)
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
    kill_site(two, two.p, [f"sidecar-{n}" for n in two.nodes] + [f"broker-{n}" for n in two.nodes])


def kill_site(two: TwoSites, site: BrokerSite, names: list[str]) -> None:
    """kill -9 the processes ``names`` of ``site``, in order, then its embedded bus."""
    for name in names + (["bus"] if site.backend == "embedded" else []):
        site.kill(name, signal.SIGKILL)


def resyncs(two: TwoSites, cluster: str) -> int:
    """Resyncs started by the sidecars of ``cluster`` (/status, ``resync.total``)."""
    return sum(int(status(two, cluster, n)["resync"]["total"]) for n in two.nodes)


def consume_all(site: Any, node: int, queue: str) -> list[str]:
    got = site.client(node, "consume", site.amqp[node], queue, "--idle", "5", "--credit", "500")
    ids: list[str] = got["ids"]
    return ids


def test_primary_killed_whole_while_publishing_recovers_all_it_settled(two: TwoSites) -> None:
    total = load(two)
    for queue in TRANSIENT:  # transient messages, at D before the power cut
        sent = two.p.client(1, "publish", two.p.amqp[1], queue, "--count", "20")
        assert sent["accepted"] == 20
    for queue in TRANSIENT:
        lab.wait_for(
            f"D holds {queue}'s transient messages",
            lambda queue=queue: converged(two, queue=queue),  # type: ignore[misc]
        )
    # Paced to last about five seconds whatever the machine's speed: the kill
    # must land in the middle (unpaced, a fast ring once had one queue's
    # whole load settled before the site was down).
    rate = str(total // 5)
    publishers = {
        q: two.p.client_popen(
            1, "publish", two.p.amqp[1], q, "--count", str(total), "--durable", "--rate", rate
        )
        for q in MODES
    }
    lab.wait_for(
        "P took part of the load",
        lambda: queues(two.p.describe(2)).get("q-enq", {}).get("depth", 0) >= total // 4,
    )
    kill_primary_site(two)
    settled = {q: int(finish_client(p)["accepted"]) for q, p in publishers.items()}
    assert all(0 < n < total for n in settled.values()), settled

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


def knocked(two: TwoSites, gone: int) -> bool:
    """A D sidecar other than ``gone`` is the ingress and answered P's HELLO
    (welcomed it, or refused it for now)."""
    for n in two.nodes:
        if n == gone:
            continue
        doc = status(two, "site-d", n)
        if doc["role"] == "ingress" and (
            doc["link_state"] == "up" or "for now" in str(doc["last_error"])
        ):
            return True
    return False


def ingested(two: TwoSites) -> int:
    """Events D's sidecars applied from the link (their metrics)."""
    total = 0.0
    for n in two.nodes:
        url = two.status_url("site-d", n).removesuffix("/status") + "/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("drgate_link_events_received_total"):
                    total += float(line.rsplit(" ", 1)[1])
    return int(total)


def test_dr_site_killed_whole_while_p_publishes_resumes_the_link_without_a_resync(
    two: TwoSites,
) -> None:
    total = load(two)
    lab.wait_for("D took the first resync (it held nothing)", lambda: converged(two))
    resyncs_before = resyncs(two, "site-p")
    # Paced to last about five seconds (as P's kill above): D's brokers must
    # stop with enough of the load still to come (unpaced, a fast ring once
    # had it all at D before they stopped).
    rate = str(total // 5)
    publishers = {
        q: two.p.client_popen(
            1, "publish", two.p.amqp[1], q, "--count", str(total), "--durable", "--rate", rate
        )
        for q in MODES
    }
    lab.wait_for(
        "D took part of the load",
        lambda: queues(two.d.describe(2)).get("q-enq", {}).get("depth", 0) >= total // 4,
    )
    # D's brokers freeze first, as behind a slow disk: D's sidecars go on
    # applying what no journal holds (and, unless they wait for D's disks,
    # acking it, so P drops it from its spool), until the power goes.
    brokers = [f"broker-{n}" for n in two.nodes]
    before = ingested(two)
    for name in brokers:
        os.kill(two.d.procs[name].pid, signal.SIGSTOP)
    lab.wait_for(
        "D's sidecars applied more than D's journals hold", lambda: ingested(two) >= before + 200
    )
    # D's ingress dies first, and a standby that applied as much takes the
    # link over before the power goes: its WELCOME must not tell P that D has
    # what no D journal holds (P drops its spool there as on an ack; a
    # fresh-clone run lost the race and P resynced D).
    sidecars = [f"sidecar-{n}" for n in two.nodes]
    first = next(n for n in two.nodes if status(two, "site-d", n)["role"] == "ingress")
    two.d.kill(f"sidecar-{first}", signal.SIGKILL)
    lab.wait_for("P's egress knocked at D's next ingress", lambda: knocked(two, first))
    kill_site(two, two.d, brokers + [s for s in sidecars if s != f"sidecar-{first}"])
    settled = {q: int(finish_client(p)["accepted"]) for q, p in publishers.items()}
    assert settled == dict.fromkeys(MODES, total), "P's publishers are not D's business"

    two.d.start()  # the same directories: every D broker recovers its journal
    for n in two.nodes:
        two.start_sidecar(two.d, n)  # waits for the site's recovery (site_live)
    lab.wait_for("D's full replica equals P's queue", lambda: converged(two), timeout=120)
    assert resyncs(two, "site-p") == resyncs_before, "P resynced D: D lost what it had acked"
    assert resyncs(two, "site-d") == 0
    for n in two.nodes:
        assert "--accept-incarnation" not in str(status(two, "site-d", n)["last_error"])

    # D's enqueue copy: every message, once, in order (R1 stayed exact).
    lab.wait_for(
        "D's enqueue queue holds every message",
        lambda: queues(two.d.describe(2))["q-enq"]["depth"] == total,
        timeout=60,
    )
    assert consume_all(two.d, 2, "q-enq") == [f"m-{i}" for i in range(1, total + 1)]
