"""The chaos runner: two durable sites, clients for the whole run, a seeded
fault schedule, quiescence, and the checker (tests/chaos/checker.py).

Importable, so that ``bench/chaos.py`` (``make chaos``) drives long runs and
``tests/chaos/test_chaos.py`` short ones::

    report = run_chaos(ChaosOptions(seed=7, faults=30, bus="embedded"))
    assert report.ok, report.text()

A run: start ``lab.site.TwoSites(durable=True)`` and its queues (one per
mode, and ``q-switch``, whose mode the rules file decides); clients
(``lab.client`` processes, ``--record``) publish durable messages to every
queue at P and consume at P and, for ``enqueue``, at D, started again each
time one ends (a broker killed under it, or its batch done); the schedule's
steps run in order, late when a restart takes longer than planned (each
sidecar's spool on a small tmpfs of its own when the schedule fills one).  Then
quiescence: the WAN restored, the rules back, every process up (one that
died without a fault is a finding), the clients stopped, the links drained
and the full replicas equal; D's enqueue queue drained by its consumer; the
queues' contents read (a holding consumer, which settles nothing) and
checked.  Once the sites stop, the Spark audit reads what the sidecars
captured (tests/chaos/audit.py).  No process and no namespace may be left
after the sites stop.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.lifetime import fill, tmpfs
from lab.netns import list_netns
from lab.site import START_TIMEOUT_S, BrokerSite, SiteError, TwoSites, finish_client
from tests.chaos import schedule as sch
from tests.chaos.audit import run_audit
from tests.chaos.checker import ACCEPTED, IN_DOUBT, Delivery, QueueRecord, check
from tests.lab import queues, status, wait_for

# Queue -> its mode at D (``q-switch``: the rules file's, full at the start
# and at the end, enqueue during a rules-switch fault).
QUEUES = {
    "q-full": "full",
    "q-enq": "enqueue",
    "q-wire": "wiring",
    "q-none": "none",
    "q-switch": "full",
}
# Messages a second each publisher offers (paced): enough to keep every link
# busy through every fault without saturating a 2-core machine.
RATE = {"q-full": 30, "q-enq": 30, "q-switch": 15, "q-wire": 5, "q-none": 5}
BATCH_S = 8.0  # one publisher process publishes this long, then the next one
P_CONSUMED = ("q-full", "q-enq", "q-switch")  # consumed at P, a few at a time
P_CONSUME_COUNT = 20  # per P consumer process: P's queues grow, slower than published
P_CONSUME_PAUSE_S = 2.0
D_CONSUMED = ("q-enq",)
# Per D consumer process: it ends after this many, or when idle.  Without a
# count a steady flow (30/s) kept it busy past CLIENT_HANG_S and it was
# reported stuck (CI's fresh seed; seed 2025 on corosync): about 10 s of flow.
D_CONSUME_COUNT = 300
SUPERVISE_TICK_S = 0.1
# The sites compare their copies this often (link.verify_s): dozens of
# comparisons in a run, each under whatever faults are on.
VERIFY_S = 5
# A client still running after this long is stuck (a batch takes BATCH_S):
# killed, and named in the report.
CLIENT_HANG_S = 45.0
FAILED_CLIENT_PAUSE_S = 1.0  # before a client that failed is started again
QUIESCE_TIMEOUT_S = 300.0
# A broker or sidecar whose corosync died must have exited within this long.
BUS_LOSS_EXIT_S = 20.0
# Each sidecar's spool disk when the schedule fills one: far more than a run
# spools, so only the fault fills it.
SPOOL_DISK_BYTES = 64 << 20
CLIENT_STOP_TIMEOUT_S = 60.0
# drgate switchover's own limit for the drain and for the handover's
# confirmation; the switch back retries D's failback this long (D may apply
# the handover only once a WAN fault ends).
SWITCHOVER_TIMEOUT_S = 60
SWITCH_BACK_TIMEOUT_S = 240.0
RULES = """\
version: 1
rules:
  - name: switch
    match: {{queue: q-switch}}
    action: {{mode: {mode}}}
default:
  mode: from-args
  fallback: none
"""


@dataclass(frozen=True, slots=True)
class ChaosOptions:
    seed: int
    faults: int = 30
    bus: str = "embedded"
    workdir: Path | None = None
    nodes: int = 3
    weights: dict[str, int] | None = None
    # How long a restarted broker or sidecar may take to be ready before the
    # run counts it as a problem (lab.site.START_TIMEOUT_S by default).  A
    # long corosync run keeps 2 cores at a load average of 16: a broker's
    # journal replay then waits for a core ten times as long as it works.
    start_timeout_s: float = START_TIMEOUT_S
    # The publishers' rates (RATE) times this.  At full rates a corosync run
    # keeps 2 cores at a load average of 16 to 20 (a message costs the sites
    # tens of ms of CPU at these rates, docs/performance.md), and a broker's
    # restart takes minutes: a 200-fault run on such a machine takes a third.
    rate_scale: float = 1.0
    # Sidecar configs that link both ways: a switchover swaps the sites in
    # place and the switch back is a second switchover, at D.
    reversible: bool = False


@dataclass
class ChaosReport:
    options: ChaosOptions
    schedule: list[sch.Fault]
    timeline: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    published: int = 0
    accepted: int = 0
    run_s: float = 0.0
    audit: str = "Spark audit: not run"

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        head = (
            f"chaos seed={self.options.seed} faults={len(self.schedule)} bus={self.options.bus}: "
            f"{'PASS' if self.ok else 'FAIL'} in {self.run_s:.0f} s; "
            f"{self.published} published, {self.accepted} accepted at P\n"
            f"faults by kind: {sch.counts(self.schedule)}\n{self.audit}\n"
        )
        problems = "".join(f"  PROBLEM {p}\n" for p in self.problems)
        return head + problems + "timeline:\n" + "".join(f"  {t}\n" for t in self.timeline)


@dataclass
class ClientSlot:
    """One client role (publish to Q at P, consume Q at P or D), run again and again."""

    name: str
    site: BrokerSite
    queue: str
    op: str  # publish | consume
    popen: subprocess.Popen[str] | None = None
    record: Path | None = None
    runs: int = 0
    next_seq: int = 1
    batch: tuple[int, int] = (0, 0)  # (start, count) of the running publisher
    not_before: float = 0.0
    started: float = 0.0
    url: str = ""
    published: dict[str, str] = field(default_factory=dict)
    deliveries: list[Delivery] = field(default_factory=list)


class Clients:
    """Every client slot, kept running by a thread until :meth:`stop`."""

    def __init__(
        self,
        two: TwoSites,
        records: Path,
        rng: random.Random,
        down: Callable[[BrokerSite, int], bool],
        rate_scale: float = 1.0,
    ) -> None:
        """``down(site, node)``: the schedule has that broker down (killed, or
        started and not yet ready: its old AMQP port may be anyone's now)."""
        self.two, self.records, self.rng, self.down = two, records, rng, down
        self.rates = {q: max(1, round(r * rate_scale)) for q, r in RATE.items()}
        records.mkdir(parents=True, exist_ok=True)
        self.slots = [ClientSlot(f"pub-{q}", two.p, q, "publish") for q in QUEUES]
        self.slots += [ClientSlot(f"pcon-{q}", two.p, q, "consume") for q in P_CONSUMED]
        self.slots += [ClientSlot(f"dcon-{q}", two.d, q, "consume") for q in D_CONSUMED]
        self.stopping = threading.Event()
        self.failed = threading.Event()  # set with ``failure``
        self.failure = ""
        self.hung: list[str] = []  # clients killed after CLIENT_HANG_S
        self.thread = threading.Thread(target=self._serve, name="chaos-clients", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """No new client; wait for the running ones (a publisher's batch ends)."""
        self.stopping.set()
        self.thread.join(timeout=CLIENT_STOP_TIMEOUT_S + BATCH_S)
        if self.thread.is_alive():
            raise SiteError(f"chaos clients did not stop in {CLIENT_STOP_TIMEOUT_S:.0f} s")

    def _serve(self) -> None:
        try:
            while True:
                running = False
                for slot in self.slots:
                    running |= self._tend(slot)
                if self.stopping.is_set() and not running:
                    return
                # Processes give no event to await: look again after a tick, or at once on stop.
                self.stopping.wait(SUPERVISE_TICK_S)
        except Exception as exc:  # reported by the run, never lost with the thread
            self.failure = f"client supervisor failed: {exc!r}"
            self.failed.set()

    def _tend(self, slot: ClientSlot) -> bool:
        """Collect a finished client, start the next; whether one still runs."""
        if slot.popen is not None:
            if slot.popen.poll() is None:
                if time.monotonic() - slot.started < CLIENT_HANG_S:
                    return True  # a consumer ends when idle, a publisher when its batch is done
                self.hung.append(f"{slot.name} run {slot.runs} on {slot.url}: {self._dump(slot)}")
            self._collect(slot)
        if self.stopping.is_set() or time.monotonic() < slot.not_before:
            return False
        self._launch(slot)
        return True

    def _dump(self, slot: ClientSlot) -> Path:
        """Kill a stuck client, its stacks first (SIGUSR1: lab/client.py
        prints them); what it recorded stands, the rest is in doubt."""
        assert slot.popen is not None and slot.record is not None
        slot.popen.send_signal(signal.SIGUSR1)
        try:
            slot.popen.wait(timeout=1.0)  # it goes on running after its dump
        except subprocess.TimeoutExpired:
            slot.popen.kill()
            slot.popen.wait(timeout=CLIENT_STOP_TIMEOUT_S)
        path = slot.record.with_suffix(".stuck.txt")
        path.write_text(slot.popen.stderr.read() if slot.popen.stderr else "")
        return path

    def _launch(self, slot: ClientSlot) -> None:
        site = slot.site
        up = [n for n in site.node_ids if n in site.amqp and not self.down(site, n)]
        if not up:
            slot.not_before = time.monotonic() + 0.5
            return
        node = self.rng.choice(up)
        url = site.amqp[node]
        slot.runs += 1
        slot.record = self.records / f"{slot.name}-{slot.runs}.jsonl"
        args = [slot.op, url, slot.queue, "--record", str(slot.record)]
        if slot.op == "publish":
            slot.batch = (slot.next_seq, int(self.rates[slot.queue] * BATCH_S))
        args += client_options(
            slot.op, slot.queue, at_p=site is self.two.p, start=slot.next_seq,
            rate=self.rates[slot.queue],
        )  # fmt: skip
        slot.popen = site.client_popen(node, *args)
        slot.started, slot.url = time.monotonic(), url

    def _collect(self, slot: ClientSlot) -> None:
        assert slot.popen is not None and slot.record is not None
        try:
            result: dict[str, Any] | None = finish_client(slot.popen, timeout=30)
        except SiteError:
            result = None
        slot.popen = None
        if result is None or result.get("error"):
            # Its broker is down or the site not live yet: do not spin.
            slot.not_before = time.monotonic() + FAILED_CLIENT_PAUSE_S
        if slot.op == "publish":
            lines = slot.record.read_text().splitlines() if slot.record.exists() else []
            seen = [json.loads(line) for line in lines]
            start, count = slot.batch
            sent = count if result is None else int(result["sent"])
            for n in range(start, start + sent):
                slot.published[f"{slot.queue}-{n}"] = IN_DOUBT
            for line in seen:
                slot.published[line["id"]] = line["outcome"]
            slot.next_seq = start + count if result is None else start + sent
        else:
            broken = result is None or bool(result.get("error"))
            slot.deliveries += deliveries(slot.record, slot.runs, broken=broken)
            if slot.site is self.two.p:
                slot.not_before = time.monotonic() + P_CONSUME_PAUSE_S


def client_options(
    op: str, queue: str, *, at_p: bool, start: int, rate: int | None = None
) -> list[str]:
    """A client run's options: a publisher's batch of ``BATCH_S`` at its rate
    (``RATE``'s unless given) from ``start``; a consumer's count, idle time
    and credit.  Every run ends on its own well within ``CLIENT_HANG_S``,
    however steady the flow."""
    if op == "publish":
        rate = RATE[queue] if rate is None else rate
        count = int(rate * BATCH_S)
        return [
            "--count", str(count), "--start", str(start), "--prefix", queue,
            "--rate", str(rate), "--durable", "--window", "20",
        ]  # fmt: skip
    if at_p:
        return ["--count", str(P_CONSUME_COUNT), "--idle", "2", "--credit", "10"]
    return ["--count", str(D_CONSUME_COUNT), "--idle", "3", "--credit", "50"]


def deliveries(record: Path, conn: int, *, broken: bool) -> list[Delivery]:
    """What a consumer's ``--record`` file says it received on connection ``conn``."""
    lines = record.read_text().splitlines() if record.exists() else []
    return [
        Delivery(d["id"], conn, broken, d.get("accepted", True), d["redelivered"])
        for d in map(json.loads, lines)
    ]


class ChaosRun:
    """One run; :func:`run_chaos` is the way in."""

    def __init__(self, options: ChaosOptions, say: Callable[[str], None]) -> None:
        self.options, self.say = options, say
        weights = options.weights or (
            sch.COROSYNC_WEIGHTS if options.bus == "corosync" else sch.WEIGHTS
        )
        self.schedule = sch.make_schedule(
            options.seed, options.faults, nodes=options.nodes, weights=weights
        )
        self.report = ChaosReport(options, self.schedule)
        self.began = time.monotonic()
        self.killed: set[tuple[str, str]] = set()  # (cluster, process) the schedule has down
        self.disks: dict[tuple[str, int], Path] = {}  # the spools' disks (spool-full)
        self.switched = False  # a switchover handed P's role to D, not yet switched back

    def log(self, text: str) -> None:
        line = f"{time.monotonic() - self.began:7.2f}s {text}"
        self.report.timeline.append(line)
        self.say(line)

    def problem(self, text: str) -> None:
        self.report.problems.append(text)
        self.log(f"PROBLEM {text}")

    # -- the run ------------------------------------------------------------

    def run(self, workdir: Path) -> ChaosReport:
        opts = self.options
        self.say(f"chaos: seed {opts.seed}, {opts.faults} faults, bus {opts.bus}, in {workdir}")
        for fault in self.schedule:
            self.say(f"  planned {fault.describe()}")
        self.rules = workdir / "rules.yaml"
        self.rules.write_text(RULES.format(mode="full"))
        two = TwoSites(
            workdir=workdir / "lab", metrics=True, bus=opts.bus, durable=True, nodes=opts.nodes,
            rules=self.rules, verify_s=VERIFY_S, capture_dir=workdir / "captures",
            reversible=opts.reversible,
        )  # fmt: skip
        self.two = two
        two.p.start_timeout_s = two.d.start_timeout_s = opts.start_timeout_s
        clients: Clients | None = None
        try:
            with ExitStack() as stack:
                # The disks first: unmounted after the sites stop.
                self.disks = self._spool_disks(stack, workdir / "disks")
                stack.enter_context(two)
                self._declare()
                clients = Clients(
                    two,
                    workdir / "records",
                    random.Random(opts.seed),
                    lambda site, n: (site.cluster, f"broker-{n}") in self.killed,
                    opts.rate_scale,
                )
                clients.start()
                self.log("clients started")
                self._run_schedule(clients)
                self._quiesce(clients)
                self._check(clients)
            self._audit(workdir)  # the sites stopped: every segment has its trailer
        except Exception as exc:
            self.problem(f"the run failed: {exc!r}")
        finally:
            self._check_leftovers(two, clients)
            self.report.run_s = time.monotonic() - self.began
        return self.report

    def _spool_disks(self, stack: ExitStack, where: Path) -> dict[tuple[str, int], Path]:
        """Every sidecar's spool on a small tmpfs of its own when the schedule
        fills one (``spool-full``): (cluster, node) -> the disk."""
        if not any(f.kind == "spool-full" for f in self.schedule):
            return {}
        disks = {}
        for site in (self.two.p, self.two.d):
            for n in self.two.nodes:
                disk = where / f"{site.cluster}-{n}"
                stack.enter_context(tmpfs(disk, size_bytes=SPOOL_DISK_BYTES))
                disks[(site.cluster, n)] = disk
                self.two.spool_dirs[(site.cluster, n)] = disk / "spool"
        return disks

    def _declare(self) -> None:
        for queue, mode in QUEUES.items():
            args = ["--replicate", mode] if queue != "q-switch" else []
            done = self.two.p.admin(1, "add-queue", queue, "--durable", *args)
            if done.returncode != 0:
                raise SiteError(f"add-queue {queue} failed: {done.stderr}")

    def _run_schedule(self, clients: Clients) -> None:
        start = time.monotonic()
        for step in sch.steps(self.schedule):
            # The schedule's own clock; a failed client supervisor ends the
            # run early (its records would no longer cover the run).
            if clients.failed.wait(max(0.0, start + step.at_s - time.monotonic())):
                self.log("schedule stopped: the client supervisor failed")
                return
            self.log(f"{step.action} {step.fault.describe()}")
            try:
                self._apply(step)
            except (SiteError, subprocess.SubprocessError, OSError) as exc:
                self.problem(f"{step.action} of fault #{step.fault.index} failed: {exc}")

    def _apply(self, step: sch.Step) -> None:
        fault, begin, two = step.fault, step.action == "begin", self.two
        where, _, which = fault.target.partition(":")
        if fault.kind in ("kill-sidecar", "kill-broker"):
            site = two.p if where == "p" else two.d
            name = f"{fault.kind.removeprefix('kill-')}-{which}"
            if begin:
                self._kill(site, [name])
            elif name == "broker-" + which:
                site.start_broker(int(which))
                self.killed.discard((site.cluster, name))
            else:
                two.start_sidecar(site, int(which))
                self.killed.discard((site.cluster, name))
        elif fault.kind == "restart-site":
            site = two.p if where == "p" else two.d
            if begin:
                names = [f"sidecar-{n}" for n in two.nodes] + [f"broker-{n}" for n in two.nodes]
                self._kill(site, names + (["bus"] if site.backend == "embedded" else []))
            else:
                self._start_site(site)
        elif fault.kind.startswith("wan-"):
            emulators = two.nodes if which == "all" else [int(which)]
            for n in emulators:
                two.wan(n, _wan_line(fault, begin))
        elif fault.kind == "partition-node":
            lab = two.labs[0 if where == "p" else 1]
            (lab.cut if begin else lab.restore)(int(which))
        elif fault.kind == "rules-switch":
            self._write_rules("enqueue" if begin else "full")
        elif fault.kind == "spool-full":
            disk = self.disks[(two.p if where == "p" else two.d).cluster, int(which)]
            if begin:
                fill(disk)
            else:
                (disk / "filler").unlink()
        elif fault.kind == "kill-corosync":
            self._corosync(two.p if where == "p" else two.d, int(which), begin)
        elif fault.kind == "switchover":
            (self._switch_over if begin else self._switch_back)()
        else:
            raise SiteError(f"unknown fault kind {fault.kind}")

    def _corosync(self, site: BrokerSite, n: int, begin: bool) -> None:
        """kill -9 node ``n``'s corosync: its broker and sidecar lose the bus
        and must exit on their own (a process that hangs on is a finding);
        at the end corosync, then they, start again, as systemd would."""
        lab = site.corosync
        assert lab is not None
        names = [f"broker-{n}", f"sidecar-{n}"]
        if not begin:
            lab.start_corosync(n)
            site.start_broker(n)
            self.two.start_sidecar(site, n)
            self.killed -= {(site.cluster, name) for name in names}
            return
        self.killed |= {(site.cluster, name) for name in names}
        lab.kill_corosync(n)
        for name in names:
            proc = site.procs[name]
            try:
                proc.popen.wait(timeout=BUS_LOSS_EXIT_S)
            except subprocess.TimeoutExpired:
                self.problem(
                    f"{site.cluster} {name} still runs {BUS_LOSS_EXIT_S:.0f} s after its "
                    f"corosync died; log: {proc.log_path}"
                )
                site.kill(name, signal.SIGKILL)

    def _switch_over(self) -> None:
        """``drgate switchover`` at P under load and whatever WAN fault is on:
        it hands P's role to D, or aborts (nothing drained in time) and P
        stays the primary; a handover it could not confirm is switched back
        all the same."""
        done = self._switchover_at(self.two.p)
        try:
            result = json.loads(done.stdout)
        except ValueError:
            self.problem(f"drgate switchover failed ({done.returncode}): {done.stderr.strip()}")
            return
        if result.get("aborted"):
            self.log("switchover aborted (nothing drained in time): P stays the primary")
            return
        self.switched = True
        self.log(
            f"switchover {'done' if result.get('switched') else 'not confirmed'}: window "
            f"{result.get('window_seconds')} s, {result.get('drained_cseqs')} cseqs drained"
            + (f", swapped: {result.get('swapped')}" if self.options.reversible else "")
        )

    def _switch_back(self) -> None:
        """The switch back: ``drgate failback`` at D (again until D applied
        the handover), then at P with the epoch D printed; with configs that
        link both ways, a second switchover, at D."""
        if not self.switched:
            return
        if self.options.reversible:
            self._switch_over_back()
            return
        two = self.two
        d_config = str(two.d.workdir / "sidecar-1.yaml")
        tries: list[subprocess.CompletedProcess[str]] = []

        def accepted() -> bool:
            tries.append(two.d.drgate(1, "failback", "--config", d_config, "--json"))
            return tries[-1].returncode == 0

        with contextlib.suppress(AssertionError):  # reported below, with D's answer
            wait_for("D applied the handover and accepts P again", accepted,
                     timeout=SWITCH_BACK_TIMEOUT_S)  # fmt: skip
        done = tries[-1]
        if done.returncode != 0:
            self.problem(f"drgate failback at D failed: {done.stdout}{done.stderr}".strip())
            return
        epoch = str(json.loads(done.stdout)["epoch"])
        p_config = str(two.p.workdir / "sidecar-1.yaml")
        done = two.p.drgate(1, "failback", "--config", p_config, "--epoch", epoch, "--json")
        if done.returncode != 0:
            self.problem(f"drgate failback at P failed: {done.stdout}{done.stderr}".strip())
            return
        self.switched = False
        self.log(f"switched back: P is the primary again at epoch {epoch}")

    @staticmethod
    def _switchover_at(site: BrokerSite) -> subprocess.CompletedProcess[str]:
        """``drgate switchover --json`` at ``site`` with its node 1's config."""
        return site.drgate(
            1, "switchover", "--config", str(site.workdir / "sidecar-1.yaml"),
            "--timeout", str(SWITCHOVER_TIMEOUT_S), "--json",
            timeout=3 * SWITCHOVER_TIMEOUT_S + 60,  # its drain, its confirmation, its bus
        )  # fmt: skip

    def _switch_over_back(self) -> None:
        """``drgate switchover`` at D, again until it swaps the sites back
        (it aborts while the WAN or a fault keeps D from draining to P, and
        refuses to start until D's egress reached P)."""
        tries: list[subprocess.CompletedProcess[str]] = []

        def swapped_back() -> bool:
            tries.append(self._switchover_at(self.two.d))
            with contextlib.suppress(ValueError):
                return bool(json.loads(tries[-1].stdout).get("switched"))
            return False

        with contextlib.suppress(AssertionError):  # reported below, with D's answer
            wait_for("D switched over back to P", swapped_back, timeout=SWITCH_BACK_TIMEOUT_S)
        done = tries[-1]
        result = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
        if not result.get("switched"):
            self.problem(f"drgate switchover at D failed: {done.stdout}{done.stderr}".strip())
            return
        self.switched = False
        self.log(
            f"switched back by a second switchover ({len(tries)} tries): window "
            f"{result.get('window_seconds')} s, {result.get('drained_cseqs')} cseqs drained, "
            f"swapped: {result.get('swapped')}"
        )

    def _kill(self, site: BrokerSite, names: list[str]) -> None:
        for name in names:
            self.killed.add((site.cluster, name))
            site.kill(name, signal.SIGKILL)

    def _start_site(self, site: BrokerSite) -> None:
        site.start()
        for n in self.two.nodes:
            self.two.start_sidecar(site, n)
        self.killed = {k for k in self.killed if k[0] != site.cluster}

    def _write_rules(self, mode: str) -> None:
        tmp = self.rules.with_suffix(".tmp")
        tmp.write_text(RULES.format(mode=mode))
        tmp.replace(self.rules)  # a new inode, as an editor writes it

    # -- quiescence ------------------------------------------------------------

    def _quiesce(self, clients: Clients) -> None:
        two = self.two
        self.log("quiescence: WAN restored, rules back, every process up, clients stop")
        for lab in two.labs:  # a partition the run failed to heal
            for n in two.nodes:
                lab.restore(n)
        two.wan_all("restore")
        two.wan_all("set delay_ms=0 jitter_ms=0 rate_bps=0")
        self._write_rules("full")
        for site in (two.p, two.d):
            self._revive(site)
        clients.stop()
        if clients.failure:
            self.problem(clients.failure)
        for hung in clients.hung:
            self.problem(f"client {hung} did not end in {CLIENT_HANG_S:.0f} s")
        self.log("clients stopped; waiting for the links to drain")
        in_a_row = [0]

        def settled() -> bool:  # drained at three looks in a row
            in_a_row[0] = in_a_row[0] + 1 if self._drained() else 0
            return in_a_row[0] >= 3

        try:
            wait_for("the sites converge", settled, timeout=QUIESCE_TIMEOUT_S)
        except AssertionError:
            self.problem(f"the sites did not converge in {QUIESCE_TIMEOUT_S:.0f} s")
            return
        self.log("links drained, full replicas equal")

    def _revive(self, site: BrokerSite) -> None:
        """Every process of ``site`` up: one down that no fault killed died on its own."""
        for name, proc in list(site.procs.items()):
            if not proc.alive() and (site.cluster, name) not in self.killed:
                self.problem(
                    f"{site.cluster} {name} exited on its own ({proc.popen.returncode}); "
                    f"log: {proc.log_path}"
                )
        if site.backend == "embedded" and not site.procs["bus"].alive():
            self._start_site(site)
            return
        for n in self.two.nodes:
            if not site.procs[f"broker-{n}"].alive():
                site.start_broker(n)
            if not site.procs[f"sidecar-{n}"].alive():
                self.two.start_sidecar(site, n)
        self.killed = {k for k in self.killed if k[0] != site.cluster}

    def _drained(self) -> bool:
        two = self.two
        try:
            for n in two.nodes:
                doc = status(two, "site-p", n)
                if doc["role"] == "egress" and (doc["lag_events"] or doc["resync"].get("active")):
                    return False
            if not any(status(two, "site-p", n)["role"] == "egress" for n in two.nodes):
                return False
            p, d = queues(two.p.describe(1)), queues(two.d.describe(1))
        except (OSError, SiteError, KeyError):
            return False
        return all(
            q in d and p[q]["digest"] == d[q]["digest"] for q, m in QUEUES.items() if m == "full"
        )

    # -- the check ----------------------------------------------------------------

    def _audit(self, workdir: Path) -> None:
        self.log("Spark audit of the sidecars' captures")
        result = run_audit(workdir / "captures", workdir / "analysis")
        self.report.audit = result.summary()
        self.log(self.report.audit)
        for text in result.problems:
            self.problem(text)

    def _check(self, clients: Clients) -> None:
        two = self.two
        for queue in D_CONSUMED:  # D's consumer takes what is left
            received = clients.records / f"final-{queue}.jsonl"
            done = two.d.client(
                1, "consume", two.d.amqp[1], queue, "--idle", "5", "--credit", "200",
                "--record", str(received),
            )  # fmt: skip
            slot = next(s for s in clients.slots if s.name == f"dcon-{queue}")
            slot.deliveries += deliveries(received, 10**6, broken=bool(done.get("error")))
        # D first: P's holding consumer acquires, and P replicates that to D.
        d_held, d_digest, d_depth = self._held(two.d)
        p_held, p_digest, _ = self._held(two.p)
        records = []
        for queue, mode in QUEUES.items():
            record = QueueRecord(queue, mode)
            for slot in clients.slots:
                if slot.queue != queue:
                    continue
                record.published.update(slot.published)
                if slot.op == "consume":
                    target = record.p_deliveries if slot.site is two.p else record.d_deliveries
                    target += slot.deliveries
            record.p_final = p_held.get(queue, [])
            record.d_final = d_held.get(queue)
            if queue in d_depth:
                record.d_readable, record.d_depth = False, d_depth[queue]
            record.p_digest, record.d_digest = p_digest.get(queue, ""), d_digest.get(queue, "")
            records.append(record)
            self.report.published += len(record.published)
            self.report.accepted += sum(o == ACCEPTED for o in record.published.values())
        for problem in check(records):
            self.problem(problem)
        self._check_verification()
        self.log(f"checked: {len(self.report.problems)} problem(s)")

    def _check_verification(self) -> None:
        """Continuous verification (every ``VERIFY_S``, under the faults) never
        found a replica different from P's: no D sidecar logged one, in any of
        its lives; and the sidecars running now made comparisons."""
        two = self.two
        differ: list[str] = []
        checks = 0
        for n in two.nodes:
            log_path = two.d.procs[f"sidecar-{n}"].log_path
            differ += [
                line.strip()
                for line in log_path.read_text(errors="replace").splitlines()
                if "verify: replica" in line and " differs from " in line
            ]
            with contextlib.suppress(OSError, KeyError, TypeError):
                checks += int(status(two, "site-d", n)["verify"]["checks_total"])
        if differ:
            self.problem(f"continuous verification found a difference ({len(differ)}): {differ[0]}")
        elif checks == 0:
            self.problem("continuous verification made no comparison at D")
        self.log(f"continuous verification: {checks} comparisons at D's running sidecars, "
                 f"{len(differ)} differences logged")  # fmt: skip

    def _held(
        self, site: BrokerSite
    ) -> tuple[dict[str, list[str]], dict[str, str], dict[str, int]]:
        """Each queue's messages at ``site`` (node 1), in order, read by a
        consumer that settles nothing, and its digest; a read-only replica
        (full, at D) is not read: its depth instead."""
        described = queues(site.describe(1))
        held: dict[str, list[str]] = {}
        replicas: dict[str, int] = {}
        for name, q in described.items():
            if name not in QUEUES:
                continue
            held[name] = []
            if (q.get("replica") or {}).get("mode") == "full":
                replicas[name] = int(q["depth"])
            elif q["depth"]:
                got = site.client(
                    1, "consume", site.amqp[1], name, "--hold", "--credit", str(q["depth"]),
                    "--count", str(q["depth"]), "--idle", "10",
                )  # fmt: skip
                held[name] = list(got["ids"])
                if len(held[name]) != q["depth"]:
                    self.problem(
                        f"{site.cluster} {name}: read {len(held[name])} of {q['depth']} messages"
                    )
        return held, {name: str(q["digest"]) for name, q in described.items()}, replicas

    def _check_leftovers(self, two: TwoSites, clients: Clients | None) -> None:
        for site in (two.p, two.d):
            for name, proc in site.procs.items():
                if proc.alive():
                    self.problem(f"{site.cluster} {name} (pid {proc.pid}) is left running")
            for popen in site.clients:
                if popen.poll() is None:
                    self.problem(f"a client of {site.cluster} (pid {popen.pid}) is left running")
        left = [n for n in list_netns() if n.startswith(("dgP", "dgD"))]
        if two.bus == "corosync" and left:
            self.problem(f"network namespaces left: {left}")


def _wan_line(fault: sch.Fault, begin: bool) -> str:
    if fault.kind == "wan-bandwidth":
        return f"set {fault.setting}" if begin else "set rate_bps=0"
    if fault.kind == "wan-delay":
        return f"set {fault.setting}" if begin else "set delay_ms=0 jitter_ms=0"
    if not begin:
        return "restore"
    return {"wan-cut": "cut", "wan-blackhole": "cut blackhole", "wan-stall": "stall"}[fault.kind]


def run_chaos(options: ChaosOptions, *, say: Callable[[str], None] = print) -> ChaosReport:
    """One chaos run (the module docstring); its report, never an exception."""
    import tempfile

    workdir = options.workdir or Path(tempfile.mkdtemp(prefix=f"chaos-{options.seed}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    return ChaosRun(options, say).run(workdir)
