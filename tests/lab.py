"""Shared lab fixtures and helpers for integration tests.

``corosync_lab(name, subnet, prefix)`` builds a 3-node corosync site in
network namespaces; in CI (``CI=true``) a missing prerequisite is a failure,
never a skip.  Every fixture tears down what it made, pass or fail, and
checks that nothing is left behind.

The two-site tests share ``wait_for`` (poll a condition against a deadline:
the other processes offer no event to await), ``queues`` (a broker's
described queues by name), ``status`` (a sidecar's /status) and
``converged`` (D's full replica equals P's queue).  ``mounted_tmpfs`` puts
a small file system under a test (a spool that fills up).
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lab.lifetime import MountError, tmpfs
from lab.netns import CorosyncSite, lab_unavailable_reason, list_netns

if TYPE_CHECKING:
    from lab.site import TwoSites

DEADLINE_S = 60.0
POLL_S = 0.1

BACKENDS = [
    pytest.param("embedded", marks=[pytest.mark.integration, pytest.mark.slow]),
    pytest.param(
        "corosync",
        marks=[pytest.mark.corosync, pytest.mark.integration, pytest.mark.slow],
    ),
]


# Two-site scenarios that test view changes run on both buses: CI (make test)
# on the embedded bus, the corosync variant with make test-long, since CI's
# 45 minutes do not hold both on a two-core machine.  The corosync bus itself
# is tested in CI by its contract (tests/cluster/bus), a broker cluster on it
# (tests/cluster/test_node.py), the lab on it (tests/gateway/test_demo.py) and
# the whole-site restarts (WHOLE_SITE_BUSES).
BUSES = ["embedded", pytest.param("corosync", marks=[pytest.mark.corosync, pytest.mark.long])]
# A whole site killed and restarted: on both buses in CI (a corosync ring
# restarting with its members is what the embedded bus cannot show).
WHOLE_SITE_BUSES = ["embedded", pytest.param("corosync", marks=[pytest.mark.corosync])]


def require_bus(bus: str) -> None:
    """:func:`require_corosync` when ``bus`` is ``"corosync"``; nothing otherwise."""
    if bus == "corosync":
        require_corosync()


def require_corosync() -> None:
    """Skip (locally) or fail (in CI, ``CI=true``) when the corosync lab cannot run here."""
    reason = corosync_unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the corosync suite must run in CI: {reason}")
        pytest.skip(reason)


def corosync_unavailable() -> str | None:
    """Why the corosync lab cannot run on this machine, or ``None`` when it can."""
    reason = lab_unavailable_reason()
    if reason is None and ctypes.util.find_library("cpg") is None:
        reason = "libcpg is not installed (apt-get install corosync)"
    return reason


@contextmanager
def corosync_lab(name: str, *, subnet: str, prefix: str, nodes: int = 3) -> Iterator[CorosyncSite]:
    """A corosync site in network namespaces (after :func:`require_corosync`);
    on exit checks that no namespace, link or process is left behind."""
    require_corosync()
    site = CorosyncSite(name, nodes=nodes, subnet=subnet, prefix=prefix)
    with site:
        yield site
    assert site.leftovers() == []
    assert [n for n in list_netns() if n.startswith(prefix)] == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    assert prefix not in links.stdout


@contextmanager
def mounted_tmpfs(path: Path, *, size_bytes: int) -> Iterator[Path]:
    """:func:`lab.lifetime.tmpfs`, skipping (locally) or failing (in CI) when
    this machine cannot mount one."""
    with ExitStack() as stack:
        try:
            disk = stack.enter_context(tmpfs(path, size_bytes=size_bytes))
        except MountError as exc:
            if os.environ.get("CI") == "true":
                pytest.fail(f"the disk-full test must run in CI: {exc}")
            pytest.skip(str(exc))
        yield disk


def wait_for(what: str, check: Callable[[], bool], *, timeout: float = DEADLINE_S) -> float:
    """Seconds it took until ``check()``; fails naming ``what`` after ``timeout``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting until {what}")
        time.sleep(POLL_S)  # polling other processes: there is no event to await
    return time.monotonic() - start


def queues(described: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A broker's ``describe`` document as {queue name: queue}."""
    return {q["name"]: q for q in described["queues"]}


def status(two: TwoSites, site: str, node: int) -> dict[str, Any]:
    """A sidecar's /status document, over HTTP."""
    with urllib.request.urlopen(two.status_url(site, node), timeout=5) as reply:
        result: dict[str, Any] = json.load(reply)
        return result


def metric(two: TwoSites, site: str, name: str, node: int = 1) -> float | None:
    """One sample of a sidecar's /metrics, scraped over HTTP (None: absent)."""
    url = two.status_url(site, node).removesuffix("/status") + "/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


def converged(two: TwoSites, d_node: int = 2, queue: str = "q-full") -> bool:
    """D's replica of ``queue`` (on broker ``d_node``) equals P's (broker 2)."""
    p, d = queues(two.p.describe(2)), queues(two.d.describe(d_node))
    return queue in d and p[queue]["digest"] == d[queue]["digest"]


def replace_file(path: Path, text: str) -> None:
    """Write ``path`` as an editor does: a new file renamed over the old one
    (a new inode, so a watcher sees it even within one mtime tick)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
