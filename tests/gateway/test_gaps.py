"""Gaps impossible, end to end: what a user checks after a fault at P is that
every message P accepted is at D exactly once and in order (``full`` queues:
P's and D's digests are equal; the ``enqueue`` queue: D holds every id once,
in order).

* an egress (or a standby that then becomes the egress) killed with
  ``SIGKILL`` during a WAN cut and restarted on its own config and spool
  while P keeps publishing;
* the whole primary site killed and started again on the same directories
  (a new incarnation): no sidecar crash-loops, and after the operator's
  ``drgate resync --accept-incarnation`` the new messages reach D;
* the active egress's spool disk full during a WAN cut while P's consumers
  take the ``enqueue`` queue: the sidecar stays up and says so in
  ``/status``, steps back, and a standby resumes D with every message.

Two sites of three brokers and three sidecars (lab.site.TwoSites); the
restart tests run on corosync in network namespaces too.
"""

from __future__ import annotations

import functools
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.site import TwoSites, finish_client
from tests import lab
from tests.lab import converged, mounted_tmpfs, queues, require_bus, status

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

DEADLINE_S = 120.0
wait_for = functools.partial(lab.wait_for, timeout=DEADLINE_S)
MODES = {"q-full": "full", "q-enq": "enqueue"}


def add_queues(two: TwoSites) -> None:
    for queue, mode in MODES.items():
        done = two.p.admin(1, "add-queue", queue, "--replicate", mode)
        assert done.returncode == 0, done.stderr


@pytest.fixture
def sites(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TwoSites]:
    """Two running sites on the bus the test is parametrised with (``bus``)."""
    bus = request.node.callspec.params["bus"]
    require_bus(bus)
    with TwoSites(workdir=tmp_path, metrics=True, bus=bus) as two:
        add_queues(two)
        yield two


def publish(two: TwoSites, count: int, *, start: int = 1, **options: str) -> list[Any]:
    """One publisher per queue, ids ``m-START`` on; options as ``rate="40"``."""
    args = ["--count", str(count), "--start", str(start)]
    args += [item for key, value in options.items() for item in (f"--{key}", value)]
    return [two.p.client_popen(1, "publish", two.p.amqp[1], queue, *args) for queue in MODES]


def finish(publishers: list[Any], count: int) -> None:
    for publisher in publishers:
        result = finish_client(publisher)
        assert result["accepted"] == count, result


def depth_at_p(two: TwoSites, queue: str = "q-enq") -> int:
    depth: int = queues(two.p.describe(2)).get(queue, {}).get("depth", 0)
    return depth


def check_d(two: TwoSites, ids: list[str]) -> None:
    """D holds exactly what P accepted: equal ``full`` digests; the
    ``enqueue`` queue holds ``ids`` once each, in order."""
    deadline = 120.0 if two.bus == "corosync" else 60.0
    try:
        lab.wait_for(
            "D's full replica equals P's queue",
            lambda: converged(two, queue="q-full"),
            timeout=deadline,
        )
        lab.wait_for(
            f"D's enqueue queue holds the {len(ids)} messages",
            lambda: queues(two.d.describe(2)).get("q-enq", {}).get("depth", 0) >= len(ids),
            timeout=deadline,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {compare(two)}") from None
    got = two.d.client(
        2, "consume", two.d.amqp[2], "q-enq", "--idle", "3", "--credit", "500"
    )  # every message there, until idle: a duplicate shows too
    assert got["ids"] == ids, "lost, doubled or reordered at D"


def compare(two: TwoSites) -> str:
    """P's and D's depths of the two queues, for a failure message."""
    p, d = queues(two.p.describe(2)), queues(two.d.describe(2))
    return ", ".join(
        f"{q}: P {p.get(q, {}).get('depth')} D {d.get(q, {}).get('depth')}" for q in MODES
    )


def ids(first: int, last: int) -> list[str]:
    return [f"m-{i}" for i in range(first, last + 1)]


def p_status(two: TwoSites, n: int) -> dict[str, Any]:
    """P's sidecar ``n``'s ``/status``; fails naming its log when it has exited."""
    proc = two.p.procs[f"sidecar-{n}"]
    if not proc.alive():
        tail = proc.log_path.read_text()[-1500:]
        raise AssertionError(
            f"P's sidecar {n} exited with {proc.popen.returncode}; log: {proc.log_path}\n{tail}"
        )
    return status(two, "site-p", n)


# ---------------------------------------------------------------------------
# A sidecar restarted on its spool while the WAN is cut
# ---------------------------------------------------------------------------

RESTARTS = [
    pytest.param("embedded", 1, id="embedded-1"),
    pytest.param("embedded", 2, id="embedded-2"),
    # Node 3, a standby like node 2 behind it: make test-long (CI's budget).
    pytest.param("embedded", 3, id="embedded-3", marks=[pytest.mark.long]),
    pytest.param("corosync", 1, id="corosync-1", marks=[pytest.mark.corosync, pytest.mark.long]),
]
# Paced publishing: 600 messages a queue at 40 a second outlast the cut,
# the kill and the restart.
STEADY, RATE = 600, "40"


@pytest.mark.parametrize(("bus", "node"), RESTARTS)
def test_egress_restarted_on_its_spool_during_a_wan_cut_loses_nothing(
    sites: TwoSites, bus: str, node: int
) -> None:
    two = sites
    publishers = publish(two, STEADY, rate=RATE)
    wait_for("P is mid-stream", lambda: depth_at_p(two) >= 100)
    two.wan_all("cut")
    two.p.kill(f"sidecar-{node}", signal.SIGKILL)
    wait_for("P takes messages while the sidecar is down", lambda: depth_at_p(two) >= 200)
    two.start_sidecar(two.p, node)  # its own config and spool
    wait_for(f"P's sidecar {node} is ready", lambda: p_status(two, node)["role"] == "standby")
    # The restarted sidecar serves D: the others go (the active one is the
    # sidecar ready longest, which a restarted one is not).
    for other in two.nodes:
        if other != node and two.p.procs[f"sidecar-{other}"].alive():
            two.p.kill(f"sidecar-{other}", signal.SIGKILL)
    wait_for(
        f"P's sidecar {node} is the egress",
        lambda: p_status(two, node)["role"] == "egress",
    )
    wait_for("P takes messages after the restart", lambda: depth_at_p(two) >= 350)
    two.wan_all("restore")
    finish(publishers, STEADY)
    check_d(two, ids(1, STEADY))
    assert p_status(two, node)["role"] == "egress"


def test_a_restarted_egress_leaves_the_link_to_the_standby_that_has_the_events(
    tmp_path: Path,
) -> None:
    # tests/chaos, seed 77: the egress restarted (an empty spool from its
    # join on) took the link back at once, found D behind its spool and
    # resynced; the messages of the enqueue queue that P's consumers took
    # in between were in no snapshot and never reached D.
    with TwoSites(workdir=tmp_path, metrics=True) as two:
        add_queues(two)
        publishers = publish(two, STEADY, rate=RATE)
        wait_for("P is mid-stream", lambda: depth_at_p(two) >= 100)
        two.wan_all("cut")
        two.p.kill("sidecar-1", signal.SIGKILL)
        wait_for("sidecar 2 takes over", lambda: p_status(two, 2)["role"] == "egress")
        two.start_sidecar(two.p, 1)
        wait_for("sidecar 1 is back", lambda: p_status(two, 1)["role"] != "starting")
        taken = two.p.client(2, "consume", two.p.amqp[2], "q-enq", "--idle", "2")
        assert taken["received"] > 0  # consumed at P: only the stream brings them to D
        two.wan_all("restore")
        finish(publishers, STEADY)
        check_d(two, ids(1, STEADY))
        assert p_status(two, 1)["role"] == "standby"
        assert p_status(two, 2)["role"] == "egress"


# ---------------------------------------------------------------------------
# The whole primary site killed and started again on its directories
# ---------------------------------------------------------------------------


def kill_primary_site(two: TwoSites) -> None:
    """``SIGKILL`` every process of P: sidecars, brokers and (embedded) the
    bus; the WAN emulators stay."""
    names = [f"sidecar-{n}" for n in two.nodes] + [f"broker-{n}" for n in two.nodes]
    if two.p.backend == "embedded":
        names.append("bus")
    for name in names:
        two.p.kill(name, signal.SIGKILL)


@pytest.mark.parametrize("bus", lab.BUSES)
def test_whole_primary_site_restart_does_not_crash_loop(sites: TwoSites, bus: str) -> None:
    two = sites
    finish(publish(two, 200), 200)
    wait_for("D holds the load", lambda: converged(two, queue="q-full"))
    wait_for(
        "D's enqueue queue holds the load",
        lambda: queues(two.d.describe(2))["q-enq"]["depth"] == 200,
    )
    held = queues(two.d.describe(2))
    kill_primary_site(two)
    two.p.start()  # the same directories: each sidecar reopens its spool
    for n in two.nodes:
        two.start_sidecar(two.p, n)
    add_queues(two)
    seen: dict[str, str] = {}

    def refused() -> bool:
        # Keep the text seen: the next attempt may end with another error.
        text = str(p_status(two, 1)["last_error"])
        if "--accept-incarnation" in text:
            seen["error"] = text
        return "error" in seen

    wait_for("P's egress is refused with the accept command", refused)
    for n in two.nodes:  # each stays up and answers
        assert p_status(two, n)["node"] == n
    after = queues(two.d.describe(2))
    assert after["q-full"]["digest"] == held["q-full"]["digest"], "D's replica was touched"
    assert after["q-enq"]["depth"] == 200, "D applied something twice (or lost it)"

    finish(publish(two, 100, start=201), 100)
    match = re.search(r"--accept-incarnation (\d+)", seen["error"])
    assert match is not None, seen["error"]
    done = two.d.drgate(
        1, "resync", "--accept-incarnation", match.group(1), "--origin", "site-p",
        "--config", str(two.d.workdir / "sidecar-1.yaml"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    check_d(two, ids(1, 300))
    for n in two.nodes:
        assert p_status(two, n)["node"] == n


# ---------------------------------------------------------------------------
# The egress's spool disk full while the WAN is cut
# ---------------------------------------------------------------------------

TMPFS_BYTES = 1 << 20
# What the filler leaves free for the spool: a few hundred 1 KB events.
ROOM_BYTES = 256 * 1024
BODY = "1000"  # characters a message


def test_disk_full_on_the_egress_spool_moves_the_link_and_loses_nothing(tmp_path: Path) -> None:
    # tests/chaos, seed 510118558: the egress's spool disk filled, the link
    # resynced, and the enqueue queue lost the messages P's consumers took
    # during the outage (a resync carries only what P's queue holds).  The
    # standbys' spools held them: the egress now steps back and one of them
    # resumes D, with no resync.
    with mounted_tmpfs(tmp_path / "tmpfs", size_bytes=TMPFS_BYTES) as disk:
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (TMPFS_BYTES - ROOM_BYTES))
        two = TwoSites(workdir=tmp_path / "sites", metrics=True)
        two.spool_dirs[("site-p", 1)] = disk / "spool-1"
        with two:
            add_queues(two)
            finish(publish(two, 20), 20)
            wait_for("the link streams", lambda: converged(two, queue="q-full"))
            two.wan_all("cut")
            finish(publish(two, 400, start=21, size=BODY), 400)

            wait_for(
                "the egress's spool write fails",
                lambda: bool(p_status(two, 1)["spool"].get("write_errors_total")),
            )
            doc = p_status(two, 1)
            assert doc["last_error"], "a full spool disk is not in /status last_error"
            wait_for("node 2 takes the link", lambda: p_status(two, 2)["role"] == "egress")
            assert p_status(two, 1)["role"] == "standby"
            # P's consumers take what the outage spooled nowhere at node 1.
            taken = two.p.client(2, "consume", two.p.amqp[2], "q-enq", "--idle", "2")
            assert taken["received"] == 420, taken
            filler.unlink()
            two.wan_all("restore")
            check_d(two, ids(1, 420))
            assert p_status(two, 2)["resync"]["total"] == 0, "D was resynced"
