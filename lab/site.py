"""A broker site on this machine: the bus, N brokers, and (later) sidecars, as processes.

Used by the integration tests, the benchmarks and the demo.  Two backends:

* ``embedded``: a ``drgate bus`` sequencer and every process on loopback,
  under one bus key per site (``bus.key`` in the site's folder, made if absent);
* ``corosync``: a :class:`lab.netns.CorosyncSite` (one network
  namespace per node), each broker started inside its node's namespace.

Every process is started here and stopped here, by its pid, also when the
caller fails (use the site as a context manager).  A process is *ready* when
it prints its ready line; waiting for it has a deadline.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.certs import SiteCert, make_site_certs
from lab.lifetime import Started
from lab.netns import CorosyncSite, ensure_key_file

# A process that has not printed its ready line by then has failed to start.
START_TIMEOUT_S = 60.0
# How long a process gets to stop on SIGTERM before SIGKILL.
STOP_TIMEOUT_S = 10.0
ROOT = Path(__file__).resolve().parents[1]
# The embedded bus's key, in the site's folder; its size is what `drgate
# keygen --bus` writes (the lab imports no project package, so it makes its own).
BUS_KEY_FILE = "bus.key"
BUS_KEY_BYTES = 32


class SiteError(RuntimeError):
    """A lab process failed to start or misbehaved; the message says where its log is."""


@dataclass
class Proc:
    """A process the site started, with the lines it printed (stdout and stderr)."""

    name: str
    popen: subprocess.Popen[str]
    log_path: Path
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    # How long a wait for a line may take (BrokerSite.start_timeout_s).
    start_timeout_s: float = START_TIMEOUT_S

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_line(self, contains: str, *, timeout: float | None = None) -> str:
        """The first printed line containing ``contains``; raises on exit or
        deadline (``timeout``, or the process's ``start_timeout_s``)."""
        timeout = self.start_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SiteError(
                    f"{self.name} did not print {contains!r} in {timeout:.0f} s; "
                    f"log: {self.log_path}"
                )
            try:
                line = self.lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                if not self.alive():
                    raise SiteError(
                        f"{self.name} exited with {self.popen.returncode} before {contains!r}; "
                        f"log: {self.log_path}\n{self.log_path.read_text()[-2000:]}"
                    ) from None
                continue
            if contains in line:
                return line


def _pump(proc: Proc) -> None:
    assert proc.popen.stdout is not None
    with proc.log_path.open("a") as log:
        for line in proc.popen.stdout:
            log.write(line)
            log.flush()
            proc.lines.put(line)
    proc.popen.stdout.close()


def drgate_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", *args]


class BrokerSite(Started):
    """A site of ``nodes`` brokers on one bus (see the module docstring)."""

    def __init__(
        self,
        cluster: str = "site-p",
        *,
        nodes: int = 3,
        backend: str = "embedded",
        corosync: CorosyncSite | None = None,
        workdir: str | Path | None = None,
        group: str = "drgate",
        durable: bool = False,
    ) -> None:
        """``durable``: every broker keeps a journal in WORKDIR/journal-N and
        the site's configs say ``bus.expect_brokers``, so a restart of the
        whole site recovers it (docs/broker.md, "Durability")."""
        if backend == "corosync" and corosync is None:
            raise SiteError("a corosync site needs a running CorosyncSite (lab.netns)")
        self.cluster = cluster
        self.node_ids = list(range(1, nodes + 1))
        self.durable = durable
        self.backend = backend
        self.corosync = corosync
        self.group = group
        self.workdir = (
            Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"site-{cluster}-"))
        )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.bus_address: str | None = None
        self.procs: dict[str, Proc] = {}
        self.clients: list[subprocess.Popen[str]] = []
        self.amqp: dict[int, str] = {}
        # How long a process started here may take to say it is ready: a
        # broker replaying its journal on a machine far busier than its cores
        # (a long chaos run) takes longer than the default.
        self.start_timeout_s = START_TIMEOUT_S

    # -- lifetime ------------------------------------------------------------

    def start(self) -> None:
        self.await_brokers(self.spawn_brokers())

    def spawn_brokers(self) -> list[tuple[int, Proc]]:
        """The bus (embedded: up once it listens), then every broker started at
        once, as a site's machines boot: :meth:`await_brokers` waits for them."""
        if self.backend == "embedded":
            self.start_bus()
        return [(node, self._spawn_broker(node)) for node in self.node_ids]

    def await_brokers(self, spawned: list[tuple[int, Proc]]) -> None:
        for node, proc in spawned:
            self._broker_ready(node, proc)

    def start_bus(self) -> None:
        argv = ["bus", "--listen", "127.0.0.1:0", "--group", self.group]
        proc = self._spawn("bus", drgate_argv(*argv, "--key-file", str(self.ensure_bus_key())))
        line = proc.wait_line("listening on")
        self.bus_address = line.split("listening on", 1)[1].split()[0]

    @property
    def bus_key_path(self) -> Path:
        return self.workdir / BUS_KEY_FILE

    def ensure_bus_key(self) -> Path:
        """The site's embedded-bus key, made if absent as ``drgate keygen
        --bus`` makes one (``BUS_KEY_BYTES`` random bytes, mode 0400): the
        sequencer, every broker and sidecar of the site and the admin tools
        run on their configs read it.  A key already there is kept."""
        return ensure_key_file(self.bus_key_path, BUS_KEY_BYTES)

    def broker_config(self, node: int) -> Path:
        if self.backend == "corosync":
            assert self.corosync is not None
            # A namespace address is not loopback: the lab's clients are
            # anonymous and plaintext, which the broker accepts only when told.
            listen = (
                f"{self.corosync.node(node).address}:5672\n"
                "  allow_plaintext: true\n  allow_anonymous: true"
            )
            bus = (
                f"  backend: corosync\n  group: {self.group}\n"
                f"  netns: {self.corosync.node(node).netns}\n"
            )
        else:
            listen = "127.0.0.1:0"
            bus = (
                f"  backend: embedded\n  group: {self.group}\n  address: {self.bus_address}\n"
                f"  key_file: {self.bus_key_path}\n"
            )
        journal = ""
        if self.durable:
            bus += f"  expect_brokers: {len(self.node_ids)}\n"
            journal = f"journal:\n  directory: {self.workdir / f'journal-{node}'}\n"
        path = self.workdir / f"broker-{node}.yaml"
        path.write_text(
            f"cluster: {self.cluster}\nnode: {node}\nbus:\n{bus}amqp:\n  listen: {listen}\n"
            + journal
        )
        return path

    def start_broker(self, node: int) -> Proc:
        return self._broker_ready(node, self._spawn_broker(node))

    def _spawn_broker(self, node: int) -> Proc:
        config = self.broker_config(node)
        return self._spawn(
            f"broker-{node}", drgate_argv("broker", "--config", str(config)), node=node
        )

    def _broker_ready(self, node: int, proc: Proc) -> Proc:
        line = proc.wait_line("ready, amqp port")
        port = int(line.rsplit("amqp port", 1)[1].strip())
        host = self.corosync.node(node).address if self.corosync is not None else "127.0.0.1"
        self.amqp[node] = f"amqp://{host}:{port}"
        return proc

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.alive():
            os.kill(proc.pid, sig)
        proc.popen.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Stop every process this site started (SIGTERM, then SIGKILL), by pid."""
        for client in self.clients:
            if client.poll() is None:
                client.kill()
                client.communicate()
        for proc in reversed(list(self.procs.values())):
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.popen.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=STOP_TIMEOUT_S)

    def _spawn(self, name: str, argv: list[str], *, node: int | None = None) -> Proc:
        if self.corosync is not None and node is not None:
            argv = self.corosync.ns_argv(node, argv)
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
        )
        proc = Proc(name, popen, self.workdir / f"{name}.log", start_timeout_s=self.start_timeout_s)
        self.procs[name] = proc
        threading.Thread(target=_pump, args=(proc,), daemon=True).start()
        return proc

    # -- clients --------------------------------------------------------------

    def client(self, node: int, *args: str, timeout: float = 300.0) -> dict[str, Any]:
        """Run ``python -m lab.client ARGS`` where node ``node``'s
        broker is reachable; its JSON result."""
        argv = [sys.executable, "-m", "lab.client", *args]
        if self.corosync is not None:
            argv = self.corosync.ns_argv(node, argv)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False
        )
        try:
            result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError) as exc:
            raise SiteError(f"client {args} failed: {done.stderr[-2000:]}") from exc
        return result

    def client_popen(self, node: int, *args: str) -> subprocess.Popen[str]:
        """Start a client without waiting; ``finish_client`` reads its result."""
        argv = [sys.executable, "-m", "lab.client", *args]
        if self.corosync is not None:
            argv = self.corosync.ns_argv(node, argv)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        popen = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
        )
        self.clients.append(popen)  # stop() ends it if the caller did not
        return popen

    def drgate(
        self, node: int, *args: str, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``drgate ARGS`` where node ``node``'s bus is reachable (its
        namespace on corosync): the admin commands that join the site's bus
        (``resync``, ``promote``)."""
        argv = drgate_argv(*args)
        if self.corosync is not None:
            argv = self.corosync.ns_argv(node, argv)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False
        )

    def describe(self, node: int) -> dict[str, Any]:
        result = self.client(node, "describe", self.amqp[node], timeout=60)
        if result.get("error"):
            raise SiteError(f"describe of node {node} failed: {result['error']}")
        described: dict[str, Any] = result["describe"]
        return described

    def admin(self, node: int, *args: str) -> subprocess.CompletedProcess[str]:
        argv = drgate_argv("admin", "--broker", self.amqp[node], *args)
        if self.corosync is not None:
            argv = self.corosync.ns_argv(node, argv)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False
        )


def finish_client(popen: subprocess.Popen[str], *, timeout: float = 300.0) -> dict[str, Any]:
    out, err = popen.communicate(timeout=timeout)
    try:
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as exc:
        raise SiteError(f"client failed: {err[-2000:]}") from exc
    return result


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections (and ``bind(0)``)."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port(within: range | None = None) -> int:
    """A TCP port free on loopback now, for a lab process to bind next.

    Chosen outside the ephemeral range (or from ``within``, which the caller
    keeps outside it): a port from ``bind(0)`` can be taken by any outgoing
    connection before its owner binds it, among them a WAN emulator
    redialling that very port while nothing listens there (a TCP
    self-connect; CI failed a test on ``Address already in use``)."""
    import random
    import socket

    ephemeral = ephemeral_ports()
    ranges = (
        [within]
        if within is not None
        else [range(20000, ephemeral.start), range(ephemeral.stop, 65536)]
    )
    candidates = [r for r in ranges if len(r) > 0]
    for _ in range(200 if candidates else 0):
        port = random.choice(random.choice(candidates))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise SiteError(f"no free TCP port in {ranges} after 200 tries")


# The rules of the lab and the demo, shipped with the package.
LAB_RULES = Path(__file__).resolve().parent / "rules.yaml"
TWO_SITE_TOKEN_MS = 3000


class TwoSites(Started):
    """Site P and site D (brokers and sidecars each) on the embedded bus,
    joined by one WAN emulator per D sidecar (lab/wan.py).

    P's sidecars list the emulators as D's addresses, in order; D's
    sidecars listen behind them.  ``wan(i, "cut")`` controls emulator i.
    """

    def __init__(
        self,
        *,
        nodes: int = 3,
        workdir: str | Path | None = None,
        delay_ms: int = 0,
        rules: Path = LAB_RULES,
        metrics: bool = False,
        capture_dir: str | Path | None = None,
        bus: str = "embedded",
        spool_max_bytes: int | None = None,
        tls: bool = True,
        durable: bool = False,
        verify_s: int | None = None,
        reversible: bool = False,
        spool_fsync: str = "never",
    ) -> None:
        """``spool_fsync``: the sidecars' ``spool.fsync`` (``never`` here: the
        lab's runs measure drgate, not this machine's disk; ``batch`` is the
        production default).  ``tls``: the link runs mutual TLS with
        certificates made in WORKDIR/tls (lab/certs.py), as a production pair
        would; False runs it with ``insecure: true``.  ``verify_s``: the sites
        compare their copies this often (the sidecars' ``link.verify_s``; None: its default).
        ``reversible``: every sidecar's config links both ways (P's sidecars
        listen too, D's list them as ``peers``, behind emulators of their
        own, ``wan-back-N``), so a planned switchover swaps the sites' roles
        in place; ``wan_all`` then acts on both directions."""
        self.reversible = reversible
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="twosites-"))
        self.tls = tls
        self._certs: dict[str, SiteCert] = {}
        self.bus = bus
        self.spool_max_bytes = spool_max_bytes
        self.spool_fsync = spool_fsync
        self.verify_s = verify_s
        self.labs: list[CorosyncSite] = []
        self._labs_up: set[str] = set()
        self.host = {"site-p": "127.0.0.1", "site-d": "127.0.0.1"}
        p_lab = d_lab = None
        if bus == "corosync":
            # Two corosync sites in namespaces, each bridge joined to the root
            # namespace, where the WAN emulators run.
            # A longer token than a single site's lab: two sites and their
            # clients load the machine, and a membership change is not what
            # these runs test (test_minority.py does, with the short token).
            p_lab = CorosyncSite(
                "site-p", nodes=nodes, subnet="10.213.20", prefix="dgP", token_ms=TWO_SITE_TOKEN_MS
            )
            d_lab = CorosyncSite(
                "site-d", nodes=nodes, subnet="10.213.21", prefix="dgD", token_ms=TWO_SITE_TOKEN_MS
            )
            self.labs = [p_lab, d_lab]
        # Each site's bus group is its cluster id; its files go in WORKDIR/p or WORKDIR/d.
        self.p, self.d = (
            BrokerSite(
                cluster,
                nodes=nodes,
                workdir=self.workdir / cluster.removeprefix("site-"),
                group=cluster,
                backend=bus,
                corosync=corosync,
                durable=durable,
            )
            for cluster, corosync in (("site-p", p_lab), ("site-d", d_lab))
        )
        self.nodes = list(range(1, nodes + 1))
        self.delay_ms = delay_ms
        self.rules = rules
        self.metrics = metrics
        # capture_dir: every sidecar records all three streams under it (gateway/capture.py)
        self.capture_dir = Path(capture_dir) if capture_dir is not None else None
        # The ports a restarted sidecar keeps (D's link ports, which the WAN
        # emulators redial while it is down, and the metrics ports) are chosen
        # here, outside the ephemeral range (free_port): one that bind(0) chose
        # could be taken meanwhile by any outgoing connection, the emulator's
        # own redial among them.  The others are chosen by the processes
        # (port 0) and read from what they print.
        self.d_listen: dict[int, int] = {}
        self.p_listen: dict[int, int] = {}  # reversible: P's link ports
        self.back_listen: dict[int, int] = {}  # reversible: the emulators D dials
        self.back_control: dict[int, int] = {}
        self.wan_listen: dict[int, int] = {}
        self.wan_control: dict[int, int] = {}
        self.metrics_port: dict[tuple[str, int], int] = {}
        # (cluster, node) -> spool directory, for a test that puts one sidecar's
        # spool elsewhere (a small tmpfs) before starting it; default WORKDIR/p/spool-N.
        self.spool_dirs: dict[tuple[str, int], Path] = {}

    def start_labs(self) -> None:
        """The corosync sites (bus=corosync), joined to the root namespace;
        nothing for the embedded bus.  ``start`` calls it; a test that starts
        the parts itself calls it first."""
        for lab in self.labs:
            if lab.name not in self._labs_up:
                lab.up()
                self.host[lab.name] = lab.attach_root()
                self._labs_up.add(lab.name)

    def start(self) -> None:
        self.start_labs()
        self._start_brokers()
        if self.reversible:
            for n in self.nodes:
                self.start_wan_back(n)
        # D's sidecars first (each binds its link port), then the emulators
        # in front of them, then P's sidecars, which need the emulators' ports.
        for n in self.nodes:
            self.start_sidecar(self.d, n)
        for n in self.nodes:
            self.start_wan(n)
        for n in self.nodes:
            self.start_sidecar(self.p, n)

    def start_p_first(self) -> None:
        """P's brokers and sidecars, D's brokers and the WAN, and no D sidecar
        yet (a D site added later: :meth:`start_d_sidecars` starts them)."""
        self.start_labs()
        self._start_brokers()
        for n in self.nodes:
            self.start_wan(n)
        for n in self.nodes:
            self.start_sidecar(self.p, n)

    def _start_brokers(self) -> None:
        """Both sites' brokers at once; the sidecars start one by one after
        them (the order they become ready in is which one is active)."""
        spawned = [(site, site.spawn_brokers()) for site in (self.p, self.d)]
        for site, procs in spawned:
            site.await_brokers(procs)

    def start_d_sidecars(self) -> None:
        for n in self.nodes:
            self.start_sidecar(self.d, n)

    def start_wan(self, n: int) -> None:
        """Emulator n: bound to a port of its choosing (no race for free ports)."""
        target = f"{self.node_address(self.d, n)}:{self.d_port(n)}"
        listen, control = self._start_emulator(self.p, f"wan-{n}", self.host["site-p"], target)
        self.wan_listen[n], self.wan_control[n] = listen, control

    def start_wan_back(self, n: int) -> None:
        """Reversible: emulator n of the other direction, which D's sidecars
        dial once D is the primary, to P sidecar n's link port (chosen now:
        P's sidecars start after D's)."""
        target = f"{self.node_address(self.p, n)}:{self.p_listen.setdefault(n, free_port())}"
        listen, control = self._start_emulator(self.d, f"wan-back-{n}", self.host["site-d"], target)
        self.back_listen[n], self.back_control[n] = listen, control

    def _start_emulator(
        self, site: BrokerSite, name: str, host: str, target: str
    ) -> tuple[int, int]:
        """A WAN emulator on ``host`` in front of ``target``: its listen and
        control ports."""
        argv = [
            sys.executable, "-m", "lab.wan",
            "--listen", f"{host}:0",
            "--target", target,
            "--control", "127.0.0.1:0",
            "--delay-ms", str(self.delay_ms),
        ]  # fmt: skip
        line = site._spawn(name, argv).wait_line("wan.serving")
        ports = re.findall(r"\('[^']*', (\d+)\)", line)
        return int(ports[0]), int(ports[2])

    def d_port(self, n: int) -> int:
        """D sidecar n's link port, chosen at its first start (or the
        emulator's, when that comes first) and kept across restarts."""
        if n not in self.d_listen:
            self.d_listen[n] = free_port()
        return self.d_listen[n]

    def wan_all(self, line: str) -> None:
        """Send ``line`` (``cut``, ``restore``, ``set ...``) to every emulator:
        the whole WAN between P and D."""
        for n in self.nodes:
            self.wan(n, line)
            if n in self.back_control:
                self._wan_send(self.back_control[n], line)

    def wan(self, n: int, line: str) -> str:
        return self._wan_send(self.wan_control[n], line)

    def _wan_send(self, control: int, line: str) -> str:
        argv = [
            sys.executable, "-m", "lab.wan",
            "--control", f"127.0.0.1:{control}", "--send", line,
        ]  # fmt: skip
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=30, cwd=ROOT, check=True
        )
        return done.stdout

    def node_address(self, site: BrokerSite, n: int) -> str:
        """Where node ``n`` of ``site`` listens (its namespace address on corosync)."""
        return "127.0.0.1" if site.corosync is None else site.corosync.node(n).address

    def sidecar_config(self, site: BrokerSite, n: int) -> Path:
        primary = site is self.p
        spool = self.spool_dirs.get((site.cluster, n), site.workdir / f"spool-{n}")
        lines = [
            f"site: {site.cluster}",
            f"role: {'primary' if primary else 'dr'}",
            f"node: {n}",
            f"peer_cluster: {self.d.cluster if primary else self.p.cluster}",
            "bus:",
            f"  backend: {site.backend}",
            f"  group: {site.group}",
            *(
                [f"  address: {site.bus_address}", f"  key_file: {site.bus_key_path}"]
                if site.backend == "embedded"
                else [f"  netns: {site.corosync.node(n).netns}"]
                if site.corosync
                else []
            ),
            *([f"  expect_brokers: {len(site.node_ids)}"] if site.durable else []),
            f"spool:\n  directory: {spool}\n  fsync: {self.spool_fsync}",
            *([f"  max_bytes: {self.spool_max_bytes}"] if self.spool_max_bytes else []),
            f"rules: {self.rules}",
        ]
        if primary:
            lines.append("peers:")
            lines += [f"  - {self.host['site-p']}:{self.wan_listen[m]}" for m in self.nodes]
        else:
            lines.append(f"listen: {self.node_address(site, n)}:{self.d_port(n)}")
        if self.reversible:  # start_wan_back chose P's ports
            if primary:
                lines.append(f"listen: {self.node_address(site, n)}:{self.p_listen[n]}")
            else:
                lines.append("peers:")
                lines += [f"  - {self.host['site-d']}:{self.back_listen[m]}" for m in self.nodes]
        lines += self._link_security(site)
        if self.verify_s is not None:
            lines.append(f"link:\n  verify_s: {self.verify_s}")
        if self.metrics:
            # A restarted sidecar keeps its port: a scraper keeps finding it.
            port = self.metrics_port.setdefault((site.cluster, n), free_port())
            lines.append(f"metrics: {self.node_address(site, n)}:{port}")
        if self.capture_dir is not None:
            lines.append(f"capture:\n  directory: {self.capture_dir / site.cluster}")
        path = site.workdir / f"sidecar-{n}.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _link_security(self, site: BrokerSite) -> list[str]:
        """The config lines of the link's security: the site's certificate
        (made with the pair's CA at the first sidecar), or ``insecure: true``."""
        if not self.tls:
            return ["insecure: true"]
        if not self._certs:
            self._certs = make_site_certs(self.workdir / "tls", [self.p.cluster, self.d.cluster])
        files = self._certs[site.cluster]
        return [f"tls: {{cert: {files.cert}, key: {files.key}, ca: {files.ca}}}"]

    def start_sidecar(self, site: BrokerSite, n: int) -> Proc:
        """Start sidecar ``n`` of ``site``; after ``site.kill(f"sidecar-{n}")``
        this restarts it on the same config, spool and (at D) link port."""
        config = self.sidecar_config(site, n)
        proc = site._spawn(f"sidecar-{n}", drgate_argv("run", "--config", str(config)), node=n)
        if self.metrics:
            line = proc.wait_line("drgate run: metrics on")
            self.metrics_port[(site.cluster, n)] = int(line.rsplit(":", 1)[1])
        if site is self.d:
            line = proc.wait_line("link listening on port")
            self.d_listen[n] = int(line.rsplit(" ", 1)[1])
        proc.wait_line("sidecar node")
        return proc

    def status_url(self, cluster: str, n: int) -> str:
        site = self.p if cluster == self.p.cluster else self.d
        return f"http://{self.node_address(site, n)}:{self.metrics_port[(cluster, n)]}/status"

    def stop(self) -> None:
        try:
            self.p.stop()
            self.d.stop()
        finally:
            for lab in self.labs:
                lab.down()
            self._labs_up.clear()
