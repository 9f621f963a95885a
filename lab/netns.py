"""A corosync site on one machine: one network namespace per node.

Layout of a site named ``NAME`` with prefix ``P`` and subnet ``10.x.y``::

    netns Pbr:   bridge "br0", ports "n1".."nN"   (the site's switch)
    netns Pn1:   "eth0" 10.x.y.1/24  <-veth->  n1 on br0     corosync nodeid 1
    netns Pn2:   "eth0" 10.x.y.2/24  <-veth->  n2 on br0     corosync nodeid 2
    ...

Every link is created directly inside the site's namespaces, so nothing of a
site appears in the root namespace and deleting the namespaces deletes the
links.  Each corosync runs as
``ip netns exec Pn1 unshare -m sh -c 'mount --bind RUN /run && exec corosync -f -c CONF'``:
a private ``/run`` (corosync's pid lock is compiled in at /run/corosync.pid)
and ``system { state_dir }`` in the node's own directory.  The ring is knet
with AES-256 and SHA-256 under one random authkey per site (``authkey`` in the
site's folder, made if absent).  Clients started
with :meth:`CorosyncSite.popen_in` reach that node's corosync only (its IPC
sockets are abstract unix sockets, which belong to the namespace).

Use it as a context manager (teardown always runs, also on failure)::

    with CorosyncSite("siteA", nodes=3, subnet="10.213.1", prefix="dgA") as site:
        site.popen_in(1, ["python", "member.py"])
        site.cut(3); ...; site.restore(3)

or from a shell: ``python -m lab.netns up --name siteA`` (prints how to
reach the nodes and keeps the site running) and ``... down --name siteA``.
Needs root, iproute2, util-linux and corosync.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lab.corosyncconf import RingNode, render_corosync_conf
from lab.lifetime import Started

# Corosync settings that form a 3-node membership in well under 2 s on the
# build machines; the token is short so that a cut node is
# noticed within about a second.
TOKEN_MS = 1000
MEMBERSHIP_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
STATE_FILE = "lab-site.json"
# The site's shared corosync key, in the site's folder; its size is
# corosync-keygen's default (knet takes 1024 to 4096 bits).
AUTHKEY_FILE = "authkey"
AUTHKEY_BYTES = 256


def lab_unavailable_reason() -> str | None:
    """Why a corosync site cannot be built here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "building network namespaces needs root (run as root or in CI)"
    for tool in ("ip", "unshare", "corosync", "corosync-quorumtool"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install corosync iproute2 util-linux)"
    return None


class LabError(RuntimeError):
    """The lab could not be built or torn down; the message says which step failed."""


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if check and result.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


@dataclass
class LabNode:
    nodeid: int
    netns: str
    address: str
    directory: Path
    port: str  # the bridge port of this node's veth, in the bridge namespace
    process: subprocess.Popen[bytes] | None = None

    @property
    def run_dir(self) -> Path:
        return self.directory / "run"

    @property
    def config_path(self) -> Path:
        return self.directory / "corosync.conf"

    @property
    def log_path(self) -> Path:
        return self.directory / "corosync.log"


class CorosyncSite(Started):
    """An N-node corosync site in network namespaces.  See the module docstring."""

    def __init__(
        self,
        name: str = "drlab",
        *,
        nodes: int = 3,
        subnet: str = "10.213.1",
        prefix: str = "dgA",
        workdir: str | Path | None = None,
        token_ms: int = TOKEN_MS,
    ) -> None:
        if not re.fullmatch(r"[A-Za-z0-9]{1,8}", prefix):
            raise LabError(f"prefix {prefix!r}: use 1 to 8 letters or digits")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise LabError(f"subnet {subnet!r}: give the first three octets, e.g. 10.213.1")
        self.name = name
        self.token_ms = token_ms
        self.prefix = prefix
        self.subnet = subnet
        self.bridge_netns = f"{prefix}br"
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"lab-{name}-"))
        self.nodes = [
            LabNode(
                nodeid=i,
                netns=f"{prefix}n{i}",
                address=f"{subnet}.{i}",
                directory=self.workdir / f"n{i}",
                port=f"n{i}",
            )
            for i in range(1, nodes + 1)
        ]
        self.namespaces_made: list[str] = []
        self.root_address: str | None = None
        self.pids_started: list[int] = []

    # -- context manager (lab.lifetime.Started) ------------------------------------

    def start(self) -> None:
        self.up()

    def stop(self) -> None:
        self.down()

    # -- building ----------------------------------------------------------------

    def node(self, nodeid: int) -> LabNode:
        return self.nodes[nodeid - 1]

    def up(self, *, timeout: float = MEMBERSHIP_TIMEOUT_S) -> None:
        """Build the namespaces and links, start every corosync, wait for full membership."""
        self.build_network()
        for node in self.nodes:
            node.run_dir.mkdir(parents=True, exist_ok=True)
            node.config_path.write_text(self.corosync_conf(node))
            self._start_corosync(node)
        self.save_state()
        self.wait_membership(timeout=timeout)

    def build_network(self) -> None:
        """The namespaces, the bridge and every node's link, and the site's
        authkey; no corosync (:meth:`up` starts them; a walkthrough starts
        its own, tests/deploy/test_walkthrough.py).  :meth:`down` undoes it."""
        reason = lab_unavailable_reason()
        if reason:
            raise LabError(reason)
        self._remove_stale()
        self.ensure_authkey()
        self._add_netns(self.bridge_netns)
        _run(["ip", "-n", self.bridge_netns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_netns, "link", "set", "br0", "up"])
        for node in self.nodes:
            self._add_netns(node.netns)
            _run(["ip", "-n", node.netns, "link", "set", "lo", "up"])
            veth = ["type", "veth", "peer", "name", node.port, "netns", self.bridge_netns]
            _run(["ip", "-n", node.netns, "link", "add", "eth0", *veth])
            _run(["ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0"])
            _run(["ip", "-n", node.netns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", self.bridge_netns, "link", "set", node.port, "master", "br0"])
            _run(["ip", "-n", self.bridge_netns, "link", "set", node.port, "up"])

    @property
    def authkey_path(self) -> Path:
        return self.workdir / AUTHKEY_FILE

    def ensure_authkey(self) -> Path:
        """The site's corosync authkey, made if absent as ``corosync-keygen -l``
        makes one: ``AUTHKEY_BYTES`` random bytes, mode 0400.  One key per site
        (every node's ``totem.keyfile`` names it); a key already there is kept."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        return ensure_key_file(self.authkey_path, AUTHKEY_BYTES)

    def corosync_conf(self, node: LabNode) -> str:
        """The node's corosync.conf, rendered as the shipped templates are
        (lab/corosyncconf.py, deploy/corosync/), with the lab's token, the
        node's own state directory and logs on stderr.

        knet encrypts and authenticates every packet with the site's authkey
        (:meth:`ensure_authkey`): a host on the ring's network that lacks the
        key can neither read the bus nor join it.  No ``uidgid`` entry: on a
        node only root's processes (the lab's) may join a CPG group."""
        ring = [RingNode(n.nodeid, f"{self.prefix}n{n.nodeid}", n.address) for n in self.nodes]
        return render_corosync_conf(
            self.name,
            ring,
            keyfile=str(self.authkey_path),
            token_ms=self.token_ms,
            uidgid=None,
            state_dir=str(node.directory),
            log_to_stderr=True,
        )

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.namespaces_made.append(name)

    def _start_corosync(self, node: LabNode) -> None:
        script = f"mount --bind {node.run_dir} /run && exec corosync -f -c {node.config_path}"
        with node.log_path.open("ab") as log:
            # ip netns exec, unshare and sh all exec: the pid is corosync's.
            node.process = subprocess.Popen(
                ["ip", "netns", "exec", node.netns, "unshare", "-m", "sh", "-c", script],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pids_started.append(node.process.pid)

    # -- running things inside nodes -----------------------------------------------

    def ns_argv(self, nodeid: int, argv: list[str]) -> list[str]:
        """``argv`` prefixed to run inside node ``nodeid``'s namespace."""
        return ["ip", "netns", "exec", self.node(nodeid).netns, *argv]

    def run_in(
        self, nodeid: int, argv: list[str], **kwargs: object
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the node's namespace and wait (output captured as text)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 30)
        return subprocess.run(self.ns_argv(nodeid, argv), check=False, **kwargs)  # type: ignore[call-overload,no-any-return]

    def popen_in(self, nodeid: int, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the node's namespace; the caller stops it by pid."""
        return subprocess.Popen(self.ns_argv(nodeid, argv), **kwargs)  # type: ignore[call-overload,no-any-return]

    # -- membership and faults -------------------------------------------------------

    def members_seen_by(self, nodeid: int) -> tuple[int, bool] | None:
        """(number of nodes in the membership, quorate) as node ``nodeid`` sees them."""
        result = self.run_in(nodeid, ["corosync-quorumtool", "-s"], timeout=10)
        nodes = re.search(r"^Nodes:\s+(\d+)", result.stdout, re.M)
        quorate = re.search(r"^Quorate:\s+(\w+)", result.stdout, re.M)
        if not nodes or not quorate:
            return None
        return int(nodes.group(1)), quorate.group(1) == "Yes"

    def wait_membership(
        self,
        *,
        expect: dict[int, int] | None = None,
        timeout: float = MEMBERSHIP_TIMEOUT_S,
    ) -> None:
        """Wait until node -> membership size matches ``expect`` (default: all see all)."""
        if expect is None:
            expect = {n.nodeid: len(self.nodes) for n in self.nodes}
        deadline = time.monotonic() + timeout
        while True:
            seen = {nodeid: self.members_seen_by(nodeid) for nodeid in expect}
            if all(s is not None and s[0] == expect[n] for n, s in seen.items()):
                return
            for node in self.nodes:
                if node.process is not None and node.process.poll() is not None:
                    raise LabError(
                        f"corosync on {node.netns} exited with {node.process.returncode}; "
                        f"see {node.log_path}"
                    )
            if time.monotonic() > deadline:
                raise LabError(
                    f"site {self.name}: membership {seen} did not reach {expect} "
                    f"within {timeout:.0f} s; logs in {self.workdir}"
                )
            time.sleep(0.2)  # polling an external tool: no event to wait on

    def attach_root(self, *, host: int = 254) -> str:
        """Join the root namespace to the site's bridge with a veth pair and
        give the root end ``SUBNET.host``: processes in the root namespace
        (WAN emulators, test clients) then reach every node directly.  The
        pair goes with the bridge namespace at ``down``.  Returns the address."""
        root_end = f"{self.prefix}root"
        _run(
            [
                "ip",
                "link",
                "add",
                root_end,
                "type",
                "veth",
                "peer",
                "name",
                "root",
                "netns",
                self.bridge_netns,
            ]
        )
        _run(["ip", "-n", self.bridge_netns, "link", "set", "root", "master", "br0"])
        _run(["ip", "-n", self.bridge_netns, "link", "set", "root", "up"])
        address = f"{self.subnet}.{host}"
        _run(["ip", "addr", "add", f"{address}/24", "dev", root_end])
        _run(["ip", "link", "set", root_end, "up"])
        self.root_address = address
        return address

    def kill_corosync(self, nodeid: int) -> None:
        """kill -9 the node's corosync (a crash: its clients lose the bus)."""
        node = self.node(nodeid)
        if node.process is None or node.process.poll() is not None:
            return
        node.process.kill()
        node.process.wait(timeout=STOP_GRACE_S)

    def start_corosync(self, nodeid: int, *, timeout: float = MEMBERSHIP_TIMEOUT_S) -> None:
        """Start the node's corosync again (after :meth:`kill_corosync`) and
        wait until every node sees every node."""
        node = self.node(nodeid)
        if node.process is not None and node.process.poll() is None:
            raise LabError(f"corosync on {node.netns} is running (pid {node.process.pid})")
        self._start_corosync(node)
        self.save_state()
        self.wait_membership(timeout=timeout)

    def cut(self, nodeid: int) -> None:
        """Take the node's bridge port down: it can no longer reach any other node."""
        _run(["ip", "-n", self.bridge_netns, "link", "set", self.node(nodeid).port, "down"])

    def restore(self, nodeid: int) -> None:
        """Bring the node's bridge port back up."""
        _run(["ip", "-n", self.bridge_netns, "link", "set", self.node(nodeid).port, "up"])

    # -- teardown --------------------------------------------------------------------

    def down(self) -> None:
        """Stop every corosync started (by pid) and delete every namespace made.

        Safe to call twice and after a partial ``up``.
        """
        errors = []
        for pid in self.pids_started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for node in self.nodes:
            if node.process is None:
                continue
            try:
                node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait(timeout=5)
        for pid in self.pids_started:
            if _pid_alive(pid):  # started by an earlier `up` process (CLI)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.pids_started.clear()
        for name in reversed(self.namespaces_made):
            result = _run(["ip", "netns", "del", name], check=False)
            if result.returncode != 0 and name in list_netns():
                errors.append(f"{name}: {result.stderr.strip()}")
        self.namespaces_made.clear()
        with contextlib.suppress(FileNotFoundError):
            (self.workdir / STATE_FILE).unlink()
        if self._own_workdir and not errors:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if errors:
            raise LabError("teardown left namespaces behind: " + "; ".join(errors))

    def _remove_stale(self) -> None:
        """Delete namespaces with this site's names left by a crashed earlier run."""
        names = {self.bridge_netns, *(n.netns for n in self.nodes)}
        for name in sorted(names & set(list_netns())):
            print(f"lab: removing stale namespace {name}", file=sys.stderr)
            _run(["ip", "netns", "del", name], check=False)
        _run(["ip", "link", "del", f"{self.prefix}root"], check=False)

    def leftovers(self) -> list[str]:
        """What of this site still exists (namespaces, processes); empty when clean."""
        names = {self.bridge_netns, *(n.netns for n in self.nodes)}
        left = [f"netns {n}" for n in sorted(names & set(list_netns()))]
        left += [
            f"corosync pid {n.process.pid}"
            for n in self.nodes
            if n.process is not None and n.process.poll() is None
        ]
        return left

    # -- state for the CLI ---------------------------------------------------------------

    def save_state(self) -> None:
        state = {
            "name": self.name,
            "prefix": self.prefix,
            "subnet": self.subnet,
            "nodes": len(self.nodes),
            "pids": self.pids_started,
            "namespaces": self.namespaces_made,
        }
        (self.workdir / STATE_FILE).write_text(json.dumps(state))

    @classmethod
    def from_state(cls, workdir: Path) -> CorosyncSite:
        state = json.loads((workdir / STATE_FILE).read_text())
        site = cls(
            state["name"],
            nodes=state["nodes"],
            subnet=state["subnet"],
            prefix=state["prefix"],
            workdir=workdir,
        )
        site.pids_started = list(state["pids"])
        site.namespaces_made = list(state["namespaces"])
        return site


def list_netns() -> list[str]:
    result = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # A zombie (an exited daemon nobody reaped yet) is not running.
    return stat.rpartition(")")[2].split()[0] != "Z"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.netns", description=__doc__)
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--name", default="drlab", help="cluster name (default %(default)s)")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--subnet", default="10.213.1", help="first three octets")
    parser.add_argument("--prefix", default="dgA", help="namespace name prefix")
    parser.add_argument("--workdir", default=None, help="default /tmp/drgate-lab-NAME")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or f"/tmp/drgate-lab-{args.name}")
    try:
        if args.action == "up":
            workdir.mkdir(parents=True, exist_ok=True)
            site = CorosyncSite(
                args.name, nodes=args.nodes, subnet=args.subnet, prefix=args.prefix, workdir=workdir
            )
            try:
                site.up()
            except BaseException:
                site.down()
                raise
            for node in site.nodes:
                print(f"node {node.nodeid}: ip netns exec {node.netns} ...  ({node.address})")
            print(
                f"site {args.name} is up; stop it with: python -m lab.netns down "
                f"--name {args.name} --workdir {workdir}"
            )
        elif args.action == "down":
            CorosyncSite.from_state(workdir).down()
            print(f"site {args.name} is down")
        else:
            site = CorosyncSite.from_state(workdir)
            for node in site.nodes:
                print(f"node {node.nodeid} ({node.netns}): {site.members_seen_by(node.nodeid)}")
    except (LabError, FileNotFoundError) as exc:
        print(f"lab: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


def ensure_key_file(path: Path, size: int) -> Path:
    """``path`` holding ``size`` random bytes, mode 0400, made if absent (a key
    already there is kept): the lab's corosync authkeys and bus keys."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    except FileExistsError:
        return path
    with os.fdopen(fd, "wb") as key:
        key.write(os.urandom(size))
    return path
