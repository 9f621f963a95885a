"""drgate side by side with RabbitMQ's shovel, end to end over the same WAN, in one run.

    .venv/bin/python bench/peer_rabbitmq.py               # both, all loads (~10 minutes)
    .venv/bin/python bench/peer_rabbitmq.py --loads 500,1000,2000 --step 5
    make bench-peer

What a user would deploy instead of drgate for this job: one RabbitMQ node
per site (Debian 12's ``rabbitmq-server`` 3.10, with the ``rabbitmq_shovel``
and ``rabbitmq_amqp1_0`` plugins) and a dynamic shovel at D pulling P's
queue with ``ack-mode: on-confirm``, through the same WAN emulator
(lab/wan.py) at the same one-way delay.  This bench installs nothing: without
``rabbitmq-server`` it prints the one command that installs it and exits 2.

Both sides take the same loads from the same Proton client processes
(lab/client.py) with the same message sizes, measured with the same
formulas (bench/e2e_bench.py ``step``): an unpaced burst (delivered/s at D)
and a sweep of offered loads (delivered/s, lag p50/p99) until saturation
(delivered < 90 % of the offer, or p99 > 5 s).  drgate runs 3 and 1
node(s) per site (brokers in memory); RabbitMQ runs a transient variant
(non-durable queues, transient messages) and a durable one (durable queues,
persistent messages: each site fsyncs before it confirms).  The tables and
the ratios drgate / RabbitMQ are printed at the end, with the CPU each
RabbitMQ node and the WAN spent per message in the bursts, and the clients'
(the two publishers and the consumer, from ``RUSAGE_CHILDREN`` around the
burst, less their start-up measured by a 10-message step just before): they
run on the same cores, so CPUs / their µs per message is the highest burst
any broker could deliver on this machine with these clients.

Each RabbitMQ node runs in a temp dir of its own: its node name, AMQP port,
distribution port, Erlang cookie (HOME), mnesia and log dirs, config file
and enabled-plugins file, under a private epmd (ERL_EPMD_PORT) that this
bench starts too; every process is stopped by its pid at the end, also on
failure.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import e2e_bench as e2e  # noqa: E402
from proccpu import CpuMeter  # noqa: E402

from lab.lifetime import Started  # noqa: E402
from lab.site import TwoSites, free_port  # noqa: E402

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
RABBIT_PLUGINS = "/usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins"
INSTALL = "sudo apt-get install -y --no-install-recommends rabbitmq-server"
QUEUE = "q-peer"
# The AMQP 1.0 plugin's address of an existing queue, for senders and receivers.
ADDRESS = f"/amq/queue/{QUEUE}"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
# The shovel's window of unconfirmed messages (its default, named here).
SHOVEL_PREFETCH = 1000


def rabbit_missing() -> str | None:
    """What of RabbitMQ is missing here, or None."""
    if not (RABBIT_BIN / "rabbitmq-server").exists():
        return "rabbitmq-server is not installed"
    plugins = " ".join(glob.glob(f"{RABBIT_PLUGINS}/*"))
    for plugin in ("rabbitmq_shovel-", "rabbitmq_amqp1_0-"):
        if plugin not in plugins:
            return f"the {plugin.rstrip('-')} plugin is missing from {RABBIT_PLUGINS}"
    return None


def pick_port() -> int:
    """A free loopback port below Linux's ephemeral range (32768 up) with
    room above it: RabbitMQ's CLI tools take the distribution port + 10000."""
    return free_port(range(20000, 32000))


def stop_pid(popen: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> None:
    """Stop a process this bench started, by its pid (then its descendants, by theirs)."""
    if popen.poll() is None:
        popen.send_signal(sig)
        try:
            popen.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for pid in descendants(popen.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            popen.kill()
            popen.wait(timeout=STOP_TIMEOUT_S)


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


class RabbitNode:
    """One RabbitMQ node in ``workdir``, on loopback, under the epmd at ``epmd_port``."""

    def __init__(self, name: str, workdir: Path, epmd_port: int, cookie: str) -> None:
        self.name = name
        self.nodename = f"{name}-{os.getpid()}@localhost"
        self.workdir = workdir
        self.amqp_port = pick_port()
        self.dist_port = pick_port()
        self.popen: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        cookie_file = workdir / ".erlang.cookie"
        cookie_file.write_text(cookie)
        cookie_file.chmod(0o400)
        (workdir / "enabled_plugins").write_text("[rabbitmq_shovel,rabbitmq_amqp1_0].\n")
        (workdir / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}\n"
            "loopback_users.guest = true\n"
            "disk_free_limit.absolute = 50MB\n"
        )
        self.env = dict(
            os.environ,
            HOME=str(workdir),
            ERL_EPMD_PORT=str(epmd_port),
            RABBITMQ_NODENAME=self.nodename,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.amqp_port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(workdir / "mnesia"),
            RABBITMQ_LOG_BASE=str(workdir / "log"),
            RABBITMQ_CONFIG_FILE=str(workdir / "rabbitmq.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(workdir / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(workdir / "rabbitmq.pid"),
        )

    @property
    def url(self) -> str:
        return f"amqp://127.0.0.1:{self.amqp_port}"

    def start(self) -> None:
        log = (self.workdir / "server.out").open("wb")
        self.popen = subprocess.Popen(
            [str(RABBIT_BIN / "rabbitmq-server")],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        # await_startup fails at once while the node is not registered with epmd yet.
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            done = self.ctl("await_startup", timeout=START_TIMEOUT_S, check=False)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline or self.popen.poll() is not None:
                raise RuntimeError(
                    f"RabbitMQ node {self.nodename} did not start: {done.stderr.strip()[-1500:]}; "
                    f"logs in {self.workdir}"
                )
            time.sleep(0.5)  # polling another process

    def ctl(
        self, *args: str, timeout: float = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(RABBIT_BIN / "rabbitmqctl"), "-n", self.nodename, *args]
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} at {self.nodename}: {done.stderr}")
        return done

    def declare(self, queue: str, *, durable: bool) -> None:
        """A classic queue (the default type of 3.10), durable or not."""
        flag = "true" if durable else "false"
        expr = (
            f'rabbit_amqqueue:declare(rabbit_misc:r(<<"/">>, queue, <<"{queue}">>), '
            f'{flag}, false, [], none, <<"bench">>).'
        )
        self.ctl("eval", expr)

    def stop(self) -> None:
        if self.popen is not None:
            stop_pid(self.popen)


class _Clients:
    """The client surface of one side, as bench/e2e_bench.py ``step`` uses a site's."""

    def __init__(self, url: str) -> None:
        self.amqp = {1: url}
        self.clients: list[subprocess.Popen[str]] = []

    def client_popen(self, node: int, *args: str) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        popen = subprocess.Popen(
            [sys.executable, "-m", "lab.client", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        self.clients.append(popen)
        return popen

    def stop(self) -> None:
        for client in self.clients:
            if client.poll() is None:
                client.kill()
                client.communicate()


class RabbitPair(Started):
    """Site P and site D as one RabbitMQ node each, a WAN emulator in front of
    P's AMQP port, and a dynamic shovel at D pulling P's queue through it.
    Quacks like :class:`lab.site.TwoSites` for ``e2e_bench.step``."""

    def __init__(self, workdir: Path, *, durable: bool, delay_ms: int = 25) -> None:
        self.workdir = workdir
        self.durable = durable
        self.delay_ms = delay_ms
        self.nodes = [1]
        self.metrics = False  # no egress /status to sample
        self.epmd_port = pick_port()
        self.epmd: subprocess.Popen[bytes] | None = None
        self.wan: subprocess.Popen[str] | None = None
        cookie = secrets.token_hex(16)
        self.rp = RabbitNode("drgate-bench-p", workdir / "p", self.epmd_port, cookie)
        self.rd = RabbitNode("drgate-bench-d", workdir / "d", self.epmd_port, cookie)
        self.p = _Clients(self.rp.url)
        self.d = _Clients(self.rd.url)

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.epmd = subprocess.Popen(
            ["epmd", "-port", str(self.epmd_port), "-address", "127.0.0.1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.rp.start()
        self.rd.start()
        for node in (self.rp, self.rd):
            node.declare(QUEUE, durable=self.durable)
        wan_port = self.start_wan()
        shovel = {
            "src-protocol": "amqp091",
            "src-uri": f"amqp://guest:guest@127.0.0.1:{wan_port}",
            "src-queue": QUEUE,
            "src-prefetch-count": SHOVEL_PREFETCH,
            "dest-protocol": "amqp091",
            "dest-uri": "amqp://",
            "dest-queue": QUEUE,
            "ack-mode": "on-confirm",
        }
        self.rd.ctl("set_parameter", "shovel", "to-d", json.dumps(shovel))
        deadline = time.monotonic() + START_TIMEOUT_S
        while "running" not in self.rd.ctl("shovel_status", check=False).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the shovel at D did not start; logs in {self.rd.workdir}")
            time.sleep(0.2)  # polling another process

    def start_wan(self) -> int:
        argv = [
            sys.executable, "-m", "lab.wan",
            "--listen", "127.0.0.1:0",
            "--target", f"127.0.0.1:{self.rp.amqp_port}",
            "--control", "127.0.0.1:0",
            "--delay-ms", str(self.delay_ms),
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        log = self.workdir / "wan.log"
        with log.open("w") as out:
            self.wan = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.wan.poll() is None:
            for line in log.read_text().splitlines():
                if "wan.serving" in line:
                    return int(re.findall(r"\('[^']*', (\d+)\)", line)[0])
            time.sleep(0.1)  # polling another process's log
        raise RuntimeError(f"the WAN emulator did not start; log: {log}")

    def pids(self) -> dict[str, int]:
        pids = {}
        procs = (("P node", self.rp.popen), ("D node", self.rd.popen), ("WAN", self.wan))
        for label, proc in procs:
            if proc is not None:
                pids[label] = proc.pid
        return pids

    def stop(self) -> None:
        try:
            self.p.stop()
            self.d.stop()
        finally:
            for proc in (self.wan,):
                if proc is not None:
                    stop_pid(proc)
            for node in (self.rd, self.rp):
                node.stop()
            if self.epmd is not None:
                stop_pid(self.epmd)


# -- runs -----------------------------------------------------------------------------


def sweep(two: Any, loads: list[int], step_s: float, publish_args: tuple[str, ...]) -> list[Any]:
    rows = []
    for load in loads:
        r = e2e.step(two, two_address(two), int(load * step_s), load, f"l{load}-", publish_args)
        rows.append(r)
        print(
            f"    offered {load}/s: delivered {r['delivered_per_s']:.0f}/s, "
            f"p99 {r['p99_ms']:.0f} ms",
            flush=True,
        )
        if (
            r["delivered_per_s"] < e2e.SATURATED_SHARE * load
            or r["p99_ms"] > 1000 * e2e.SATURATED_P99_S
        ):
            break
    return rows


def burst_with_clients(
    two: Any,
    address: str,
    count: int,
    publish_args: tuple[str, ...] = (),
    meter: CpuMeter | None = None,
) -> tuple[dict[str, Any], float, dict[str, float]]:
    """The unpaced burst (e2e ``step``), the µs of CPU its client processes
    spent per message delivered, their start-up left out (a step of 10
    messages just before costs the same start-up), and what ``meter`` read
    over the burst alone."""

    def step(n: int, tag: str) -> tuple[dict[str, Any], float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = e2e.step(two, address, n, 0, tag, publish_args)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        return result, spent

    _, start_up = step(10, "s")
    if meter is not None:
        meter.start()
    burst, spent = step(count, "b")
    servers = meter.stop() if meter is not None else {}
    return burst, 1e6 * max(0.0, spent - start_up) / max(1, burst["delivered"]), servers


def two_address(two: Any) -> str:
    return ADDRESS if isinstance(two, RabbitPair) else e2e.QUEUE


def run_drgate(workdir: Path, nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    print(f"drgate, {nodes} node(s) per site ...", flush=True)
    with TwoSites(nodes=nodes, delay_ms=args.delay_ms, workdir=workdir / f"drgate-{nodes}") as two:
        e2e.declare(two, e2e.QUEUE)
        burst, clients, _ = burst_with_clients(two, e2e.QUEUE, args.burst)
        print(f"    burst: {burst['delivered_per_s']:.0f}/s", flush=True)
        rows = sweep(two, args.load_list, args.step, ()) if nodes in args.sweep_nodes else []
    return {"burst": burst, "rows": rows, "cpu": {}, "clients_us": clients}


def run_rabbit(workdir: Path, durable: bool, args: argparse.Namespace) -> dict[str, Any]:
    label = "durable" if durable else "transient"
    print(f"RabbitMQ + shovel, {label} ...", flush=True)
    publish_args = ("--durable",) if durable else ()
    with RabbitPair(workdir / f"rabbit-{label}", durable=durable, delay_ms=args.delay_ms) as two:
        burst, clients, spent = burst_with_clients(
            two, ADDRESS, args.burst, publish_args, CpuMeter(two.pids())
        )
        if burst["delivered"] < args.burst:
            raise RuntimeError(
                f"RabbitMQ {label}: the burst delivered {burst['delivered']} of {args.burst}: "
                f"{burst['errors']}; logs in {two.workdir}"
            )
        print(f"    burst: {burst['delivered_per_s']:.0f}/s", flush=True)
        rows = sweep(two, args.load_list, args.step, publish_args)
    cpu = {k: 1e6 * v / max(1, burst["delivered"]) for k, v in spent.items()}
    return {"burst": burst, "rows": rows, "cpu": cpu, "clients_us": clients}


# -- report ---------------------------------------------------------------------------


def kept(rows: list[dict[str, Any]]) -> float:
    """The highest offered load kept: delivered >= 90 %, p99 < 5 s."""
    best = 0.0
    for r in rows:
        if (
            r["delivered_per_s"] >= e2e.SATURATED_SHARE * r["offered"]
            and r["p99_ms"] <= 1000 * e2e.SATURATED_P99_S
        ):
            best = max(best, r["offered"])
    return best


def lag_at(rows: list[dict[str, Any]], load: int) -> float | None:
    for r in rows:
        if r["offered"] == load:
            return float(r["p99_ms"])
    return None


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    names = list(results)
    width = max(24, *(len(n) + 2 for n in names))
    print(f"\nmessages of ~10 bytes, {args.delay_ms} ms one way, one run")
    print(f"{'figure':<44}" + "".join(f"{n:>{width}}" for n in names))

    def line(label: str, values: list[str]) -> None:
        print(f"{label:<44}" + "".join(f"{v:>{width}}" for v in values))

    line(
        f"unpaced burst of {args.burst}, delivered/s at D",
        [f"{results[n]['burst']['delivered_per_s']:.0f}" for n in names],
    )
    line(
        "highest offered load kept (≥90 %, p99<5 s)",
        [f"{kept(results[n]['rows']):.0f}/s" if results[n]["rows"] else "—" for n in names],
    )
    for load in args.load_list:
        cells = []
        for n in names:
            lag = lag_at(results[n]["rows"], load)
            cells.append("—" if lag is None else f"{lag:.0f} ms")
        line(f"lag p99 at {load}/s offered", cells)
    cpus = os.cpu_count() or 1
    for n in names:
        for role, us in results[n]["cpu"].items():
            print(f"  {n}: {role} {us:.0f} µs CPU per message (burst)")
        clients = results[n]["clients_us"]
        print(
            f"  {n}: clients (2 publishers, 1 consumer) {clients:.0f} µs CPU per message "
            f"(burst): on {cpus} CPUs they alone allow {1e6 * cpus / max(1.0, clients):.0f}/s"
        )
    rabbits = [n for n in names if n.startswith("RabbitMQ")]
    drgates = [n for n in names if n.startswith("drgate")]
    print("\nratios drgate / RabbitMQ (burst delivered/s; highest load kept)")
    for d in drgates:
        for r in rabbits:
            burst = results[d]["burst"]["delivered_per_s"] / results[r]["burst"]["delivered_per_s"]
            text = f"  {d} / {r}: burst {burst:.2f}"
            if results[d]["rows"] and kept(results[r]["rows"]):
                text += f", load kept {kept(results[d]['rows']) / kept(results[r]['rows']):.2f}"
            print(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loads", default="500,1000,2000,4000,8000")
    parser.add_argument("--step", type=float, default=8.0, help="seconds per load step")
    parser.add_argument("--burst", type=int, default=4000)
    parser.add_argument("--delay-ms", type=int, default=25)
    parser.add_argument("--drgate-nodes", default="3,1", help="drgate site sizes to run")
    parser.add_argument("--sweep-nodes", default="3", help="drgate site sizes that also sweep")
    parser.add_argument("--no-drgate", action="store_true", help="RabbitMQ only")
    args = parser.parse_args()
    args.load_list = [int(x) for x in args.loads.split(",")]
    args.sweep_nodes = {int(x) for x in args.sweep_nodes.split(",")}
    missing = rabbit_missing()
    if missing is not None:
        print(f"{missing}; install it with:\n  {INSTALL}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    results: dict[str, dict[str, Any]] = {}
    if not args.no_drgate:
        for nodes in (int(x) for x in args.drgate_nodes.split(",")):
            results[f"drgate {nodes}+{nodes}"] = run_drgate(workdir, nodes, args)
    results["RabbitMQ transient"] = run_rabbit(workdir, False, args)
    results["RabbitMQ durable"] = run_rabbit(workdir, True, args)
    print(f"load average at end: {os.getloadavg()[0]:.2f}", flush=True)
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
