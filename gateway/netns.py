"""A bus in another network namespace: the admin commands join from inside it.

A corosync daemon serves the clients of its own network namespace (libqb's
IPC sockets are abstract sockets, which are per namespace).  In production
the daemon, the brokers, the sidecars and the operator's shell share the
host's namespace.  In the lab (``drgate lab up --bus corosync``) each node
runs in a namespace of its own, and the configs the lab writes say which
(``bus.netns``).  A command that joins the bus as a short-lived member
(``drgate promote``, ``resync``, ``recover``, ``failback``) started from
another namespace runs itself again inside that one, through ``ip netns
exec``, so that the operator's shell works as documented.
"""

from __future__ import annotations

import os
import sys

from cluster.bus import BusConfig
from protocol.errors import DrgateError

NETNS_DIR = "/run/netns"  # where `ip netns add` keeps the named namespaces


def enter_bus_netns(bus: BusConfig) -> None:
    """Re-run this command inside ``bus.netns`` unless it already runs
    there (or the config names none); never returns when it re-runs."""
    if bus.netns is None:
        return
    target = os.path.join(NETNS_DIR, bus.netns)
    try:
        there = os.stat(target).st_ino
    except OSError as exc:
        raise DrgateError(
            f"the config's bus.netns {bus.netns!r} does not exist ({target}: {exc.strerror}); "
            "is the lab up? ('drgate lab up --bus corosync' makes its namespaces)"
        ) from None
    if os.stat("/proc/self/ns/net").st_ino == there:
        return
    argv = ["ip", "netns", "exec", bus.netns, sys.executable, "-m", "gateway.cli", *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        raise DrgateError(
            f"cannot enter network namespace {bus.netns!r} with 'ip netns exec' "
            f"({exc.strerror}); run the command as root, or from inside it"
        ) from None
