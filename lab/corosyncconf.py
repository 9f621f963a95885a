"""The one writer of ``corosync.conf``: the namespace lab's nodes and the
shipped templates (deploy/corosync/) are both rendered here.

A site's corosync ring is knet, encrypted and authenticated with AES-256 and
SHA-256 under one authkey per site (``corosync-keygen``, copied to every
node, mode 0400): a host on the ring's network without the key can neither
read the bus nor join it.  Quorum depends on the number of nodes; the
rendered file explains the choice in its comments (:func:`quorum_section`).

From a shell (the operator's way, docs/operations.md "Running under systemd")::

    python3 -m lab.corosyncconf --cluster-name site-p \\
        --node p1=10.0.0.1 --node p2=10.0.0.2 --node p3=10.0.0.3 > corosync.conf

Nodes are numbered 1, 2, 3... in the order given: that number is the
corosync nodeid, which is the ``node`` of the broker and sidecar configs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

# Where Debian's corosync looks for the key (corosync-keygen's default output).
DEFAULT_KEYFILE = "/etc/corosync/authkey"
# corosync's own default token (ms): the lab passes a shorter one.
DEFAULT_TOKEN_MS = 3000
# The user drgate runs as (deploy/systemd/drgate.sysusers): its uidgid entry
# lets it join CPG groups; without one only root's processes may.
DEFAULT_UIDGID = "drgate"


@dataclass(frozen=True, slots=True)
class RingNode:
    """A node of the ring: its corosync nodeid, name and ring address."""

    nodeid: int
    name: str
    address: str


def quorum_section(node_count: int) -> str:
    """The ``quorum`` section for a site of ``node_count`` nodes, with why."""
    lines = ["quorum {", "    provider: corosync_votequorum"]
    if node_count == 2:
        lines = [
            "# Two nodes.  A plain majority needs both (2 of 2 votes).  The usual",
            "# `two_node: 1` lets either node alone carry on, but after a split BOTH",
            "# halves stay quorate and only fencing, which drgate does not do, picks",
            "# a survivor: both brokers would accept publishes and one half's would",
            "# be lost at the merge.  So auto_tie_breaker instead: the half holding",
            "# the lowest nodeid (node 1) stays quorate and the other refuses",
            "# publishes (a minority, docs/broker.md) until the split heals.  Node 1",
            "# alone carries on; node 2 alone stops.  Keep two_node out: next to",
            "# auto_tie_breaker corosync disables it (and logs that it did).",
            "# wait_for_all: a freshly started site is quorate only once both nodes",
            "# have seen each other, so a node booting alone does not start a site.",
            *lines,
            "    auto_tie_breaker: 1",
            "    auto_tie_breaker_node: lowest",
            "    wait_for_all: 1",
        ]
    elif node_count >= 3:
        lines = [
            f"# {node_count} nodes, one vote each: a partition holding a majority "
            f"({node_count // 2 + 1} of {node_count})",
            "# is quorate and carries on; the others refuse publishes (a minority,",
            "# docs/broker.md) and rejoin when the split heals.",
            "# wait_for_all: a freshly started site is quorate only once every node",
            "# has been seen, so a site never starts without one of its members.",
            *lines,
            "    wait_for_all: 1",
        ]
    return "\n".join([*lines, "}"]) + "\n"


def render_corosync_conf(
    cluster_name: str,
    nodes: Sequence[RingNode],
    *,
    keyfile: str = DEFAULT_KEYFILE,
    token_ms: int = DEFAULT_TOKEN_MS,
    uidgid: str | None = DEFAULT_UIDGID,
    state_dir: str | None = None,
    log_to_stderr: bool = False,
) -> str:
    """A ``corosync.conf`` for ``nodes`` (one key per line: corosync's parser
    wants it).  ``uidgid``: the user and group admitted to CPG groups besides
    root (None: none, as in the lab, where everything runs as root);
    ``state_dir``: corosync's state directory (None: its default,
    /var/lib/corosync); ``log_to_stderr``: log to stderr instead of syslog.
    Raises ``ValueError`` on an empty ``nodes`` or a repeated nodeid."""
    if not nodes:
        raise ValueError("a corosync site needs at least one node")
    if len({n.nodeid for n in nodes}) != len(nodes):
        raise ValueError(f"nodeids repeat in {[n.nodeid for n in nodes]}")
    nodelist = "".join(
        "    node {\n"
        f"        ring0_addr: {n.address}\n"
        f"        nodeid: {n.nodeid}\n"
        f"        name: {n.name}\n"
        "    }\n"
        for n in nodes
    )
    text = (
        "# Rendered by lab/corosyncconf.py; the same on every node of the site.\n"
        "totem {\n"
        "    version: 2\n"
        f"    cluster_name: {cluster_name}\n"
        "    transport: knet\n"
        "    # Every packet encrypted and authenticated under the site's authkey\n"
        "    # (corosync-keygen, copied to every node, mode 0400).\n"
        "    crypto_cipher: aes256\n"
        "    crypto_hash: sha256\n"
        f"    keyfile: {keyfile}\n"
        f"    token: {token_ms}\n"
        "}\n"
        f"nodelist {{\n{nodelist}}}\n" + quorum_section(len(nodes)) + "logging {\n"
        f"    to_stderr: {'yes' if log_to_stderr else 'no'}\n"
        f"    to_syslog: {'no' if log_to_stderr else 'yes'}\n"
        "    to_logfile: no\n"
        "    timestamp: on\n"
        "}\n"
    )
    if uidgid is not None:
        text += (
            f"# The drgate brokers and sidecars run as {uidgid}: admit it to CPG groups.\n"
            f"uidgid {{\n    uid: {uidgid}\n    gid: {uidgid}\n}}\n"
        )
    if state_dir is not None:
        text += f"system {{\n    state_dir: {state_dir}\n}}\n"
    return text


def _ring_node(nodeid: int, spec: str) -> RingNode:
    name, sep, address = spec.partition("=")
    if not sep or not name or not address:
        raise ValueError(f"--node {spec!r}: give NAME=ADDRESS, e.g. p1=10.0.0.1")
    return RingNode(nodeid, name, address)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m lab.corosyncconf", description=__doc__)
    parser.add_argument("--cluster-name", required=True, help="the site's cluster id")
    parser.add_argument(
        "--node", action="append", required=True, metavar="NAME=ADDRESS", help="in nodeid order"
    )
    parser.add_argument("--keyfile", default=DEFAULT_KEYFILE)
    parser.add_argument("--token-ms", type=int, default=DEFAULT_TOKEN_MS)
    args = parser.parse_args(argv)
    try:
        nodes = [_ring_node(i, spec) for i, spec in enumerate(args.node, start=1)]
        text = render_corosync_conf(
            args.cluster_name, nodes, keyfile=args.keyfile, token_ms=args.token_ms
        )
    except ValueError as exc:
        print(f"lab.corosyncconf: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
