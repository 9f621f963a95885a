"""docs/operations.md, "Running under systemd", run as written on two sites of three
nodes in network namespaces.

Every node is a network namespace (lab/netns.py, no corosync started) and a mount
namespace of its own, held open by a ``sleep`` process: ``/etc``, ``/var``,
``/usr/bin`` and ``/root`` are overlays of the host's (what a node installs, users included,
stays in it) and ``/run`` is a tmpfs.  Each ``sh`` block of the section runs in
every node (``nsenter`` into the holder's namespaces, ``bash -e``, from the
checkout) before the next block starts, with the node's settings in front, as an
operator runs them on every node in turn.

PID 1 is not systemd: ``systemctl`` is lab/units.py (the units' ExecStart as
their User, Restart=on-failure, stop timeout; no sandboxing), installed by the
test as /usr/bin/systemctl in every node.  What the test does instead of the
text, because it cannot be done here as written:

* ``# settings of this node``: the lab's names and addresses; P reaches D's
  sidecars through one WAN emulator each (lab/wan.py, in the root namespace);
* ``# install drgate``: /usr/bin/drgate runs this checkout's ``gateway.cli``
  with the test's interpreter (no venv, no package download), which the
  ``drgate`` user may run (``/root``, an overlay too, opened for traversal);
* ``# copy the authkey ...``: node 1's key is copied into the others (no scp).

The certificates are made by the ``sh`` block of "Certificates for the link".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.netns import CorosyncSite, LabNode
from tests.lab import require_corosync, wait_for

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
SECTION = "## Running under systemd"
SITES = {"site-p": ("10.213.40", "dgWP"), "site-d": ("10.213.41", "dgWD")}
LINK_PORT = 7500
STATUS_URL = "http://127.0.0.1:9464"
BLOCK_TIMEOUT_S = 120.0


def section_blocks(text: str, heading: str) -> list[str]:
    """The ``sh`` blocks under ``heading``, up to the next heading of its level."""
    level = heading.split(maxsplit=1)[0]
    start = text.index(heading + "\n") + len(heading)
    end = re.compile(rf"^{level} ", re.M).search(text, start)
    body = text[start : end.start() if end else len(text)]
    return re.findall(r"^```sh\n(.*?)^```$", body, re.M | re.S)


class Node:
    """One node: its namespaces, held by a process, and a way to run shell in them."""

    def __init__(self, site: CorosyncSite, lab_node: LabNode, folder: Path) -> None:
        self.site = site
        self.lab_node = lab_node
        self.folder = folder
        self.holder: subprocess.Popen[str] | None = None

    @property
    def name(self) -> str:
        return f"{self.site.name}/{self.lab_node.nodeid}"

    def start(self) -> None:
        mounts = []
        for top in ("etc", "var", "usr/bin", "root"):
            upper, work = self.folder / f"{top}.up", self.folder / f"{top}.work"
            upper.mkdir(parents=True)
            work.mkdir(parents=True)
            options = f"lowerdir=/{top},upperdir={upper},workdir={work}"
            mounts.append(f"mount -t overlay overlay -o {options} /{top}")
        mounts += ["mount -t tmpfs tmpfs /run", "echo ready", "exec sleep 86400"]
        script = " && ".join(mounts)
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script]
        self.holder = subprocess.Popen(
            self.site.ns_argv(self.lab_node.nodeid, argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline()
        assert line.strip() == "ready", f"{self.name}: the node's mounts failed: {line}"

    def run(self, script: str, *, timeout: float = BLOCK_TIMEOUT_S) -> str:
        """``script`` in this node as root with ``bash -e``; its output, or fail."""
        assert self.holder is not None
        argv = ["nsenter", "-t", str(self.holder.pid), "-m", "-n", f"--wd={ROOT}"]
        argv += ["bash", "-e", "-c", script]
        done = subprocess.run(
            argv, capture_output=True, text=True, cwd=ROOT, timeout=timeout, check=False
        )
        assert done.returncode == 0, (
            f"{self.name}: exit {done.returncode}\n--- script\n{script}\n--- output\n"
            f"{done.stdout[-3000:]}{done.stderr[-3000:]}\n--- units\n{self.unit_logs()}"
        )
        return done.stdout

    def unit_logs(self) -> str:
        assert self.holder is not None
        argv = ["nsenter", "-t", str(self.holder.pid), "-m", "sh", "-c"]
        argv.append("tail -n 20 /run/drgate-units/*.log 2>&1")
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

    def stop(self) -> None:
        """Stop the units (as an operator would), then every process left in
        the node's namespace, by pid (all of them were started here)."""
        if self.holder is None:
            return
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            self.run(
                "systemctl stop drgate-sidecar@sidecar drgate-broker@broker corosync",
                timeout=60,
            )
        netns = self.lab_node.netns
        pids = subprocess.run(
            ["ip", "netns", "pids", netns], capture_output=True, text=True, check=False
        )
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        self.holder.wait(timeout=10)
        if self.holder.stdout is not None:
            self.holder.stdout.close()


@contextlib.contextmanager
def two_sites(tmp_path: Path) -> Iterator[dict[str, list[Node]]]:
    """Two lab sites of three namespaces each, joined to the root namespace;
    every node's holder started; everything undone on exit."""
    labs = [
        CorosyncSite(name, nodes=3, subnet=subnet, prefix=prefix, workdir=tmp_path / name)
        for name, (subnet, prefix) in SITES.items()
    ]
    nodes: dict[str, list[Node]] = {}
    try:
        for lab in labs:
            lab.build_network()
            lab.attach_root()
            nodes[lab.name] = [Node(lab, n, tmp_path / "hosts" / n.netns) for n in lab.nodes]
            for node in nodes[lab.name]:
                node.start()
        yield nodes
    finally:
        for site_nodes in nodes.values():
            for node in site_nodes:
                node.stop()
        for lab in labs:
            lab.down()


def start_wan(p_root: str, d_address: str, log: Path, procs: list[subprocess.Popen[bytes]]) -> int:
    """A WAN emulator in the root namespace from P's side to a D sidecar; its port."""
    argv = [
        sys.executable, "-m", "lab.wan", "--listen", f"{p_root}:0",
        "--target", f"{d_address}:{LINK_PORT}", "--control", "127.0.0.1:0",
    ]  # fmt: skip
    with log.open("wb") as out:
        procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT))
    wait_for(f"the WAN emulator to {d_address} serves", lambda: "wan.serving" in log.read_text())
    line = next(x for x in log.read_text().splitlines() if "wan.serving" in x)
    return int(re.findall(r"\('[^']*', (\d+)\)", line)[0])


def settings(node: Node, nodes: dict[str, list[Node]], d_sidecars: str, pki: Path) -> str:
    site = node.site.name
    ring = " ".join(f"{n.lab_node.netns}={n.lab_node.address}" for n in nodes[site])
    primary = site == "site-p"
    return (
        f"SITE={site} PEER_SITE={'site-d' if primary else 'site-p'} "
        f"ROLE={'primary' if primary else 'dr'} NODE={node.lab_node.nodeid} "
        f"ADDRESS={node.lab_node.address}\n"
        f'RING="{ring}"\nD_SIDECARS="{d_sidecars}"\nPKI={pki}\n'
    )


INSTALL = f"""cat > /usr/bin/drgate <<'EOF'
#!/bin/sh
PYTHONPATH={ROOT} exec {sys.executable} -m gateway.cli "$@"
EOF
cat > /usr/bin/systemctl <<'EOF'
#!/bin/sh
PYTHONPATH={ROOT} exec {sys.executable} -m lab.units "$@"
EOF
chmod 0755 /usr/bin/drgate /usr/bin/systemctl
# The interpreter may live under /root (pyenv): let the drgate user reach it
# (in this node's overlay of /root only).
chmod o+x /root
"""


def status(node: Node) -> dict[str, object]:
    out = node.run(f"drgate status --url {STATUS_URL} --json")
    document: dict[str, object] = json.loads(out)[0]
    return document


def service_pids(node: Node, needle: str) -> list[int]:
    netns = node.lab_node.netns
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, check=False)
    found = []
    for pid in pids.stdout.split():
        with contextlib.suppress(FileNotFoundError):
            argv = Path(f"/proc/{int(pid)}/cmdline").read_bytes().split(b"\0")
            if b"gateway.cli" in argv and needle.encode() in argv:
                found.append(int(pid))
    return found


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.corosync
@pytest.mark.integration
def test_the_walkthrough_gives_three_systemd_nodes_per_site(tmp_path: Path) -> None:
    require_corosync()
    text = OPERATIONS.read_text()
    blocks = section_blocks(text, SECTION)
    assert blocks[0].startswith("# settings of this node"), "the first block is the settings"
    pki = tmp_path / "pki"
    pki.mkdir()
    certificates = section_blocks(text, "### Certificates for the link")
    subprocess.run(["bash", "-e", "-c", certificates[0]], cwd=pki, check=True, capture_output=True)
    wans: list[subprocess.Popen[bytes]] = []
    try:
        with two_sites(tmp_path) as nodes:
            p_root = nodes["site-p"][0].site.root_address
            assert p_root is not None
            ports = [
                start_wan(p_root, n.lab_node.address, tmp_path / f"wan-{i}.log", wans)
                for i, n in enumerate(nodes["site-d"], start=1)
            ]
            d_sidecars = ", ".join(f"{p_root}:{port}" for port in ports)
            everyone = nodes["site-p"] + nodes["site-d"]
            for text_block in blocks[1:]:
                first = text_block.splitlines()[0]
                block = INSTALL if first == "# install drgate" else text_block
                if first.startswith("# copy the authkey"):
                    for site_nodes in nodes.values():
                        key = site_nodes[0].run("base64 /etc/corosync/authkey")
                        for other in site_nodes[1:]:
                            other.run(
                                f"echo '{key}' | base64 -d > /etc/corosync/authkey\n"
                                "chmod 0400 /etc/corosync/authkey"
                            )
                    continue
                targets = [n for n in everyone if n.lab_node.nodeid == 1]
                if first != "# node 1 only":
                    targets = everyone
                for node in targets:
                    node.run(settings(node, nodes, d_sidecars, pki) + block)
            check_the_sites(nodes)
    finally:
        for wan in wans:
            wan.kill()
            wan.wait()


def check_the_sites(nodes: dict[str, list[Node]]) -> None:
    """Roles, link, users, and Restart=on-failure of a broker killed -9."""
    # one active sidecar per site (the one ready longest: any node), the others standbys
    for site, active, standby in (
        ("site-p", "egress", "standby"),
        ("site-d", "ingress", "ingress-standby"),
    ):
        docs = [status(n) for n in nodes[site]]
        assert sorted(str(d["role"]) for d in docs) == sorted([active, standby, standby]), docs
        [leader] = [d for d in docs if d["role"] == active]
        assert leader["link_state"] == "up", leader
    p3 = nodes["site-p"][2]
    [broker] = service_pids(p3, "broker")
    owner = Path(f"/proc/{broker}/status").read_text()
    uid = int(re.search(r"^Uid:\s+(\d+)", owner, re.M).group(1))  # type: ignore[union-attr]
    assert uid != 0, "the broker runs as User=drgate, not root"
    assert p3.run(f"getent passwd {uid}").startswith("drgate:")
    os.kill(broker, signal.SIGKILL)
    wait_for(
        "the broker killed -9 is restarted",
        lambda: service_pids(p3, "broker") not in ([], [broker]),
    )
    p3.run(
        'timeout 60 sh -c \'until grep -c "ready, amqp port" '
        "/run/drgate-units/drgate-broker@broker.log | grep -qx 2; do sleep 1; done'"
    )
    assert "exited with -9" in p3.run("cat /run/drgate-units/drgate-broker@broker.log")
