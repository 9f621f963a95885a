"""Observability end to end: /metrics, /status and ``drgate status`` on two running sites.

One two-site lab (3 brokers + 3 sidecars per site, metrics on), plus a fourth
broker at D started with ``metrics:`` so that the broker's endpoint is
scraped too.  A known workload runs while the WAN is cut, so that every P
sidecar's spool holds all of it; then:

* the counters scraped over real HTTP (parsed with prometheus-client's text
  parser) equal what the tap must produce for that workload;
* ``drgate status --json`` shows the active egress and ingress, a lag above
  zero while the WAN is cut and falling to zero once it is restored;
* a forced replay: the events of a stopped P standby's spool, already applied
  at D, are sent again to D's active ingress over a real link connection
  (``protocol.link.LinkSender``, same origin and incarnation); D's merge rule
  R1 drops every one of them, and ``drgate_duplicates_dropped_total`` rises by
  exactly the replayed count on every D member (sidecars and the broker).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from proton.utils import BlockingConnection

from gateway.spool import Spool
from lab.site import ROOT, Proc, TwoSites, drgate_argv, finish_client
from protocol import link
from tests.lab import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

DEADLINE_S = 60.0
MODES = {"q-full": "full", "q-enq": "enqueue", "q-wire": "wiring", "q-none": "none"}
# The workload: N to the full queue, M to the enqueue queue, K to each of the
# wiring and none queues, P consumed (accepted) from the full queue at P.
N, M, K, P = 120, 80, 30, 40

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """``/metrics`` over HTTP, parsed by prometheus-client: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = reply.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as reply:
        document: dict[str, Any] = json.load(reply)
        return document


def drgate_status(two: TwoSites) -> list[dict[str, Any]]:
    """``drgate status --json`` against every (running) sidecar of both sites."""
    urls = [f"--url=http://127.0.0.1:{port}" for port in two.metrics_port.values()]
    done = subprocess.run(
        drgate_argv("status", *urls, "--json"),
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    documents: list[dict[str, Any]] = json.loads(done.stdout)
    assert len(documents) == len(two.metrics_port)
    return documents


def active(documents: list[dict[str, Any]], role: str) -> dict[str, Any]:
    rows = [d for d in documents if d.get("role") == role]
    assert len(rows) == 1, f"expected one {role}: {[(d['site'], d['role']) for d in documents]}"
    return rows[0]


def start_metrics_broker(two: TwoSites, node: int) -> tuple[Proc, int]:
    """A further broker at D with ``metrics: 127.0.0.1:0``; its metrics port."""
    config = two.d.broker_config(node)
    config.write_text(config.read_text() + "metrics: 127.0.0.1:0\n")
    proc = two.d._spawn(
        f"broker-{node}",
        drgate_argv("broker", "--config", str(config), "--log-format", "json"),
        node=node,
    )
    port = int(proc.wait_line("metrics on").rsplit(":", 1)[1])
    proc.wait_line("ready, amqp port")
    return proc, port


def replay(
    address: tuple[str, int], incarnation: int, events: list[tuple[int, int, bytes]]
) -> tuple[int, link.PeerError]:
    """Send ``events`` (already applied at D) again to D's active ingress.

    Connects as P (same origin and incarnation) with resume point 0.  D answers
    WELCOME with what it has applied; the link only carries seqs above that,
    so the events get fresh link seqs above it, while their payloads (the
    ``Replicated`` commands with P's original cseqs) are unchanged.  D's
    ingress admits no event whose command claims another position than its
    own (gateway/admission.py): returns D's resume point and its refusal.
    """
    sender = link.LinkSender(
        link.SenderConfig(
            origin_cluster="site-p", target_cluster="site-d", incarnation=incarnation, epoch=1
        )
    )
    deadline = time.monotonic() + DEADLINE_S
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(sender.start(time.monotonic(), resume_point=0))
        resume: int | None = None
        target: int | None = None
        while True:
            now = time.monotonic()
            assert now < deadline, "the replay was not acked in time"
            out = sender.data_to_send(now)
            if out:
                sock.sendall(out)
            next_at = sender.tick(now)
            sock.settimeout(max(0.001, min(0.1, (next_at or now + 0.1) - now)))
            try:
                data = sock.recv(65536)
            except TimeoutError:
                data = None
            if data is not None:
                sender.receive_data(data)
            while True:
                ev = sender.next_event()
                if ev is link.NEED_DATA:
                    break
                if isinstance(ev, link.Welcome):
                    resume = ev.resume_from
                    for i, (_, time_us, payload, _prev) in enumerate(events, start=1):
                        sender.send_event(link.LinkEvent(resume + i, time_us, payload))
                    target = resume + len(events)
                elif isinstance(ev, link.PeerError):
                    assert resume is not None and target is not None
                    return resume, ev
                elif isinstance(ev, link.Acked | link.PongReceived):
                    continue
                else:
                    raise AssertionError(f"the ingress ended the replay: {ev}")


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoSites]:
    # Plaintext: the test's own replaying link client speaks no TLS.  No
    # continuous verification: its points are events too, and this test
    # counts every event of its workload.
    with TwoSites(workdir=tmp_path, metrics=True, tls=False, verify_s=0) as sites:
        yield sites


def one_by_one(url: str, queue: str, count: int) -> int:
    """Receive and accept ``count`` messages, the next one asked for only
    after the accept: each accept reaches the broker alone, so each is one
    event (the broker makes one command of the accepts that arrive together)."""
    conn = BlockingConnection(url, timeout=60)
    try:
        receiver = conn.create_receiver(queue, credit=1)
        for _ in range(count):
            receiver.receive(timeout=60)
            receiver.accept()
        return count
    finally:
        conn.close()


def test_counters_status_and_replayed_duplicates(two: TwoSites) -> None:
    _, broker_port = start_metrics_broker(two, 4)
    for queue, mode in MODES.items():
        done = two.p.admin(1, "add-queue", queue, "--replicate", mode)
        assert done.returncode == 0, done.stderr
    egress_port = two.metrics_port[("site-p", 1)]
    ingress_port = two.metrics_port[("site-d", 1)]
    wait_for(
        "the declarations are acked by D",
        lambda: status(egress_port)["lag_events"] == 0 and status(egress_port)["acked_seq"] > 0,
    )
    acked_before = status(egress_port)["acked_seq"]

    # The workload, with the WAN cut: every P spool holds all of it.
    for n in two.nodes:
        two.wan(n, "cut")
    publishers = [
        two.p.client_popen(1, "publish", two.p.amqp[1], queue, "--count", str(count))
        for queue, count in (("q-full", N), ("q-enq", M), ("q-wire", K), ("q-none", K))
    ]
    for publisher in publishers:
        result = finish_client(publisher, timeout=60)
        assert result["rejected"] == 0 and result["error"] == "", result
    assert one_by_one(two.p.amqp[2], "q-full", P) == P
    # Events of the workload: the publishes to full and enqueue queues, and
    # the accepts of q-full, one event each unless the broker took two that
    # arrived together as one command (CI saw 239 of 240): the count is what
    # the egress holds once it stops changing, three looks in a row.
    looks: list[int] = []

    def settled() -> bool:
        looks.append(status(egress_port)["lag_events"])
        return len(looks) >= 3 and looks[-1] == looks[-2] == looks[-3] >= N + M + 1

    wait_for("the egress has tapped the whole workload", settled)
    expected_lag = looks[-1]
    assert N + M < expected_lag <= N + M + P, looks[-3:]
    during_cut = drgate_status(two)
    egress = active(during_cut, "egress")
    assert (egress["site"], egress["node"]) == ("site-p", 1)
    assert egress["lag_events"] == expected_lag
    assert egress["lag_seconds"] > 0

    # A standby's spool, read after it stopped: the events to replay later.
    two.p.kill("sidecar-3", signal.SIGTERM)
    del two.metrics_port[("site-p", 3)]
    with Spool.open(two.p.workdir / "spool-3", fsync="never") as spool:
        # A standby trims by the watermark the egress announces at most once a
        # second: it may still hold some declarations; the replay is the workload.
        spooled = spool.read_after(acked_before, 1 << 30)
    assert len(spooled) == expected_lag, "the standby's spool holds the whole workload"

    for n in two.nodes:
        two.wan(n, "restore")
    wait_for(
        "`drgate status` shows the lag at zero",
        lambda: active(drgate_status(two), "egress")["lag_events"] == 0,
    )
    documents = drgate_status(two)
    egress, ingress = active(documents, "egress"), active(documents, "ingress")
    assert (egress["site"], egress["node"], egress["link_state"]) == ("site-p", 1, "up")
    assert (ingress["site"], ingress["node"], ingress["link_state"]) == ("site-d", 1, "up")
    assert egress["lag_seconds"] == 0
    assert egress["acked_seq"] == egress["last_seq"] == spooled[-1][0]
    assert {d["role"] for d in documents if d["site"] == "site-p"} == {"egress", "standby"}
    assert {d["role"] for d in documents if d["site"] == "site-d"} == {
        "ingress",
        "ingress-standby",
    }

    # Counters equal the workload's counts (see gateway/tap.py: one event per
    # replicated declare, per publish routed to a full/enqueue queue, per
    # accept on a full queue; wiring and none publishes are filtered).
    p_metrics = scrape(egress_port)
    forwarded = {
        mode: value(p_metrics, "drgate_events_forwarded_total", mode=mode)
        for mode in ("full", "enqueue", "wiring", "none")
    }
    accepts = expected_lag - N - M  # P, or fewer when two accepts went as one command
    assert forwarded == {"full": 1 + N + accepts, "enqueue": 1 + M, "wiring": 1, "none": 0}
    assert value(p_metrics, "drgate_events_filtered_total", mode="wiring") == K
    assert value(p_metrics, "drgate_events_filtered_total", mode="none") == 1 + K
    assert value(p_metrics, "drgate_tap_commands_total", kind="PUBLISH") == N + M + 2 * K
    assert value(p_metrics, "drgate_tap_commands_total", kind="ACCEPT") == accepts
    assert value(p_metrics, "drgate_tap_commands_total", kind="QUEUE_DECLARE") == 4
    assert value(p_metrics, "drgate_events_dropped_total") == 0
    assert value(p_metrics, "drgate_role", role="egress", site="site-p", node="1") == 1
    assert value(p_metrics, "drgate_link_up") == 1
    assert value(p_metrics, "drgate_lag_events") == 0
    assert value(p_metrics, "drgate_link_reconnects_total") >= 1  # the cut
    total_events = sum(forwarded.values())
    d_metrics = scrape(ingress_port)
    assert value(d_metrics, "drgate_role", role="ingress") == 1
    assert value(d_metrics, "drgate_link_events_received_total") == total_events
    # A D that has applied nothing is seeded by a resync first (one applied
    # ResyncApply command), then streamed.
    resyncs = value(d_metrics, "drgate_resyncs_total")
    assert value(d_metrics, "drgate_replicated_applied_total") == total_events + resyncs
    assert value(d_metrics, "drgate_duplicates_dropped_total") == 0
    # A standby at P taps the same stream: the same counts.
    assert value(scrape(two.metrics_port[("site-p", 2)]), "drgate_events_forwarded_total") == (
        total_events
    )

    # The broker's endpoint: same merge counters as the sidecars, no role or link.
    d_members = [ingress_port, two.metrics_port[("site-d", 2)], two.metrics_port[("site-d", 3)]]
    d_members.append(broker_port)
    wait_for(
        "every D member applied the stream",
        lambda: all(
            value(scrape(port), "drgate_replicated_applied_total") == total_events + resyncs
            for port in d_members
        ),
    )
    broker = scrape(broker_port)
    assert value(broker, "drgate_bus_quorate", process="broker", site="site-d", node="4") == 1
    assert value(broker, "drgate_role") == 0 and value(broker, "drgate_link_up") == 0
    assert not any(name.startswith("drgate_link") for name, _ in broker)
    assert status(broker_port)["process"] == "broker"

    # A forced replay of events D applied, at fresh link positions: D's
    # ingress refuses it before anything reaches D's bus (an event's command
    # must claim its own position), and counts it.
    incarnation = two.p.describe(1)["incarnation"]
    resume, refusal = replay(("127.0.0.1", two.d_listen[1]), incarnation, spooled)
    assert resume == spooled[-1][0], "D resumes after the last event it applied"
    assert refusal.code == link.LinkErrorCode.FORBIDDEN, refusal
    replayed = len(spooled)
    wait_for(
        "D counted the refused event",
        lambda: value(scrape(ingress_port), "drgate_link_refused_total") == 1,
    )
    for port in d_members:
        samples = scrape(port)
        assert value(samples, "drgate_replicated_applied_total") == total_events + resyncs
        assert value(samples, "drgate_duplicates_dropped_total") == 0
    d_metrics = scrape(ingress_port)
    assert value(d_metrics, "drgate_merge_conflicts_total") == 0
    # D's queues did not change: the full replica still equals P's queue.
    p_queues = {q["name"]: q for q in two.p.describe(2)["queues"]}
    d_queues = {q["name"]: q for q in two.d.describe(2)["queues"]}
    assert d_queues["q-full"]["digest"] == p_queues["q-full"]["digest"]
    assert d_queues["q-full"]["depth"] == N - P
    assert d_queues["q-enq"]["depth"] == M
    print(
        f"forwarded {forwarded}; a replay of {replayed} events after D's point {resume} "
        "was refused by D's ingress"
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v", "-s"]))
