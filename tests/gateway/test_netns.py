"""gateway/netns: the admin commands join a bus in another network namespace
from inside it (the re-run through ``ip netns exec`` is exercised end to end
by tests/gateway/test_demo.py, ``drgate promote`` against ``lab up --bus
corosync`` from the test's own namespace)."""

from __future__ import annotations

import pytest

from cluster.bus import BusConfig
from gateway.netns import enter_bus_netns
from protocol.errors import DrgateError


def test_a_bus_in_the_hosts_namespace_is_joined_where_the_command_runs() -> None:
    enter_bus_netns(BusConfig("corosync", "site-p", 1))  # returns: nothing to enter


def test_a_namespace_that_does_not_exist_is_named_with_the_fix() -> None:
    bus = BusConfig("corosync", "site-p", 1, netns="drgate-no-such-ns")
    with pytest.raises(DrgateError, match=r"bus.netns 'drgate-no-such-ns' does not exist.*lab up"):
        enter_bus_netns(bus)
