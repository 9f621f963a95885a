"""A sidecar cut off in a minority partition of its site stops acting and says why.

Corosync only: the embedded bus has no partitions.  Three corosync daemons in
network namespaces, a broker and a sidecar on each node; node 3's link is
taken down.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.netns import CorosyncSite
from lab.site import LAB_RULES, BrokerSite, drgate_argv
from tests.lab import corosync_lab, wait_for

pytestmark = [pytest.mark.corosync, pytest.mark.integration, pytest.mark.slow, pytest.mark.e2e]

STATUS_PORT = 9464
DEADLINE_S = 60.0


@pytest.fixture
def site(tmp_path: Path) -> Iterator[BrokerSite]:
    with (
        corosync_lab("minority", subnet="10.213.9", prefix="dgM") as lab,
        BrokerSite("site-p", nodes=3, backend="corosync", corosync=lab, workdir=tmp_path) as s,
    ):
        for node in s.node_ids:
            config = tmp_path / f"sidecar-{node}.yaml"
            config.write_text(
                "\n".join(
                    [
                        "site: site-p",
                        "role: primary",
                        f"node: {node}",
                        "peer_cluster: site-d",
                        # Nobody listens there: the egress keeps retrying, which
                        # is what a P site without its D looks like.
                        "peers: [127.0.0.1:9]",
                        "bus:\n  backend: corosync\n  group: drgate",
                        f"spool:\n  directory: {tmp_path / f'spool-{node}'}\n  fsync: never",
                        f"rules: {LAB_RULES}",
                        f"metrics: {lab.node(node).address}:{STATUS_PORT}",
                        "insecure: true",
                    ]
                )
                + "\n"
            )
            proc = s._spawn(
                f"sidecar-{node}", drgate_argv("run", "--config", str(config)), node=node
            )
            proc.wait_line("sidecar node")
        yield s


def status(lab: CorosyncSite, node: int) -> dict[str, Any]:
    """The sidecar's /status, fetched from inside node 1's namespace (the
    test's own namespace has no route to the lab's)."""
    url = f"http://{lab.node(node).address}:{STATUS_PORT}/status"
    code = f"import urllib.request;print(urllib.request.urlopen({url!r},timeout=3).read().decode())"
    asking = 1 if node != 1 else 2
    done = lab.run_in(asking if node == 3 else node, [sys.executable, "-c", code], timeout=10)
    if done.returncode != 0:
        return {"error": done.stderr[-300:]}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_minority_sidecar_stops_and_says_why(site: BrokerSite) -> None:
    lab = site.corosync
    assert lab is not None
    wait_for("node 1 is the active egress", lambda: status(lab, 1).get("role") == "egress")
    assert status(lab, 2)["role"] == "standby"
    lab.cut(3)
    try:
        wait_for("node 3 knows it is in a minority", lambda: _role_seen_from_3(lab) == "minority")
        cut_off = _status_from_3(lab)
        assert "minority partition" in cut_off["last_error"]
        assert cut_off["bus"]["quorate"] is False
        # The majority carries on: still quorate, node 1 still the egress.
        majority = status(lab, 1)
        assert majority["role"] == "egress"
        assert majority["bus"]["quorate"] is True
        assert site.admin(1, "add-queue", "during-partition").returncode == 0
        assert (
            site.client(1, "publish", site.amqp[1], "during-partition", "--count", "5")["accepted"]
            == 5
        )
        # Node 3's broker accepts nothing there: what it applied alone would be
        # dropped at the heal, so a settled message would be lost.
        refused = site.client(3, "publish", site.amqp[3], "q-minority", "--count", "1")
        assert refused["accepted"] == 0
        assert "minority partition" in (refused["error"] or refused["first_rejection"])
        assert "minority partition" in site.admin(3, "add-queue", "q-minority").stderr
    finally:
        lab.restore(3)
    wait_for("node 3 is a standby again", lambda: _role_seen_from_3(lab) == "standby")
    assert _status_from_3(lab)["last_error"] == ""
    # Node 3 rejoined by state transfer: it holds what the majority did meanwhile.
    wait_for(
        "node 3's broker holds the majority's state",
        lambda: _queues_at(site, 3) == _queues_at(site, 1),
    )
    assert _queues_at(site, 3)["during-partition"]["depth"] == 5
    assert "q-minority" not in _queues_at(site, 3)
    again = site.client(3, "publish", site.amqp[3], "during-partition", "--count", "1")
    assert again["accepted"] == 1


def _queues_at(site: BrokerSite, node: int) -> dict[str, Any]:
    return {q["name"]: q for q in site.describe(node)["queues"]}


def _status_from_3(lab: CorosyncSite) -> dict[str, Any]:
    # While cut off, node 3 is reachable only from its own namespace.
    url = f"http://{lab.node(3).address}:{STATUS_PORT}/status"
    code = f"import urllib.request;print(urllib.request.urlopen({url!r},timeout=3).read().decode())"
    done = lab.run_in(3, [sys.executable, "-c", code], timeout=10)
    if done.returncode != 0:
        return {}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _role_seen_from_3(lab: CorosyncSite) -> str | None:
    role: str | None = _status_from_3(lab).get("role")
    return role
