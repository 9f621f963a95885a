"""Shared lab fixtures for integration tests: sites on either bus backend.

``corosync_lab(name, subnet, prefix)`` builds a 3-node corosync site in
network namespaces; in CI (``CI=true``) a missing prerequisite is a failure,
never a skip.  Every fixture tears down what it made, pass or fail, and
checks that nothing is left behind.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from deploy.lab.netns import CorosyncSite, lab_unavailable_reason, list_netns

BACKENDS = [
    pytest.param("embedded", marks=[pytest.mark.integration, pytest.mark.slow]),
    pytest.param(
        "corosync",
        marks=[pytest.mark.corosync, pytest.mark.integration, pytest.mark.slow],
    ),
]


def corosync_unavailable() -> str | None:
    reason = lab_unavailable_reason()
    if reason is None and ctypes.util.find_library("cpg") is None:
        reason = "libcpg is not installed (apt-get install corosync)"
    return reason


@contextmanager
def corosync_lab(name: str, *, subnet: str, prefix: str, nodes: int = 3) -> Iterator[CorosyncSite]:
    reason = corosync_unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the corosync suite must run in CI: {reason}")
        pytest.skip(reason)
    site = CorosyncSite(name, nodes=nodes, subnet=subnet, prefix=prefix)
    with site:
        yield site
    assert site.leftovers() == []
    assert [n for n in list_netns() if n.startswith(prefix)] == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    assert prefix not in links.stdout
