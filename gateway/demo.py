"""The two-site demo (``drgate demo``, ``make demo``): replication you can watch.

Theory of operation: :class:`lab.site.TwoSites` starts site P and
site D (three brokers and three sidecars each, on the embedded bus, loopback)
joined by one WAN emulator per D sidecar with a one-way delay.  Queues in all
four modes are declared at P; Proton client processes publish to each of them
at P at a paced rate (stamped with their send time), consume part of the
``full`` queue at P and the whole ``enqueue`` queue at D.  A sampler thread
reads every sidecar's ``/status`` and both sites' queue listing once a second,
and a rich live view shows them.  Halfway through, the active egress's
sidecar is SIGKILLed and the view shows which standby takes over and how
long it took.  At the end the invariants are checked, each with a deadline,
and a summary table is printed; :func:`run_demo` returns 0 when all hold.

Every process is started by ``TwoSites`` or here and stopped by pid on the
way out, on success, failure, Ctrl-C or SIGTERM alike.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from lab.client import Describer
from lab.site import SiteError, TwoSites, finish_client

# The queues of the demo, one per mode.
QUEUES = {"q-full": "full", "q-enq": "enqueue", "q-wire": "wiring", "q-none": "none"}
# One-way WAN delay between the sites: a metro-to-region link.
WAN_DELAY_MS = 25
# Defaults that keep a whole run (start, stream, checks, stop) well under two minutes
# on two shared cores: startup ~15 s, stream 30 s, drain and checks ~10 s.
DEFAULT_DURATION_S = 30.0
DEFAULT_RATE = 50.0
# Deadlines: a takeover or a convergence slower than this is a failure, not a wait.
TAKEOVER_DEADLINE_S = 30.0
CONVERGE_DEADLINE_S = 60.0
# How often the live view is refreshed from /status and the queue listings.
SAMPLE_INTERVAL_S = 1.0
HTTP_TIMEOUT_S = 2.0
DESCRIBE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class DemoOptions:
    duration_s: float = DEFAULT_DURATION_S
    rate: float = DEFAULT_RATE
    kill: bool = True
    workdir: Path | None = None


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class DemoResult:
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)


@dataclass
class Sample:
    """What the live view shows; replaced whole by the sampler thread."""

    status: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    queues_p: dict[str, dict[str, Any]] = field(default_factory=dict)
    queues_d: dict[str, dict[str, Any]] = field(default_factory=dict)


class _OneShotDescriber(Describer):
    """The lab client's describer without reconnect: one try, then give up."""

    def on_start(self, event: Any) -> None:
        conn = event.container.connect(self.url, reconnect=False)
        event.container.create_receiver(conn, "$drgate.queues")


def describe(url: str, timeout: float = DESCRIBE_TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """The broker's queues by name, in process (cheaper than a client process per second);
    empty when the broker does not answer within ``timeout``."""
    from proton.reactor import Container

    handler = _OneShotDescriber(url)
    thread = threading.Thread(target=lambda: Container(handler).run(), daemon=True)
    thread.start()
    thread.join(timeout)
    if not isinstance(handler.body, dict):
        return {}
    return {q["name"]: q for q in handler.body.get("queues", [])}


def fetch_status(port: int) -> dict[str, Any]:
    """A sidecar's /status, or ``{"error": ...}`` when it does not answer."""
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/status", timeout=HTTP_TIMEOUT_S
        ) as reply:
            document: dict[str, Any] = json.load(reply)
            return document
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}


def wait_for(check: Callable[[], bool], timeout: float, interval: float = 0.2) -> float | None:
    """Seconds until ``check()`` held, or None after ``timeout``.  Polls: the
    things waited on are other processes, with no event to await."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            return None
        time.sleep(interval)
    return time.monotonic() - start


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (``drgate lab down``, a test harness) unwinds like Ctrl-C, so the
    ``finally`` blocks stop every process."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Demo:
    def __init__(self, options: DemoOptions, console: Console) -> None:
        self.options = options
        self.console = console
        self.count = max(1, int(options.rate * options.duration_s))
        self.sample = Sample()
        self.events: list[str] = []
        self.phase = "starting"
        self.started = time.monotonic()
        self.stream_started: float | None = None
        self.clients: list[subprocess.Popen[str]] = []
        self.max_lag_s = 0.0
        self._stop = threading.Event()

    # -- the view -------------------------------------------------------------

    def log(self, line: str) -> None:
        stamp = time.monotonic() - self.started
        self.events.append(f"[{stamp:6.1f} s] {line}")

    def render(self) -> Group:
        elapsed = time.monotonic() - self.started
        streamed = time.monotonic() - self.stream_started if self.stream_started else 0.0
        head = Text(
            f"drgate demo  {elapsed:5.1f} s  phase: {self.phase}  "
            f"(stream {streamed:4.1f}/{self.options.duration_s:.0f} s, "
            f"{self.count} msgs per queue at {self.options.rate:.0f}/s, "
            f"WAN {WAN_DELAY_MS} ms one way)",
            style="bold",
        )
        sidecars = Table(title="sidecars (/status)", expand=True)
        for column in ("site", "node", "role", "link", "lag events", "lag s", "events/s", "rtt ms"):
            sidecars.add_column(column, justify="right" if column[0] in "lert" else "left")
        for (site, node), doc in sorted(self.sample.status.items()):
            if "error" in doc:
                sidecars.add_row(site, str(node), "[red]down[/red]", "", "", "", "", "")
                continue
            rates = doc.get("rates") or {}
            rate = rates.get("events_forwarded_per_second") or rates.get(
                "events_received_per_second"
            )
            role = str(doc.get("role", ""))
            style = "green" if role in ("egress", "ingress") else "dim"
            sidecars.add_row(
                site,
                str(node),
                f"[{style}]{role}[/{style}]",
                str(doc.get("link_state", "")),
                _num(doc.get("lag_events"), "{:.0f}"),
                _num(doc.get("lag_seconds"), "{:.2f}"),
                _num(rate, "{:.0f}"),
                _num(
                    doc.get("rtt_seconds") and doc["rtt_seconds"] * 1000,
                    "{:.0f}",
                ),
            )
        queues = Table(title="queues (depth at P and at D)", expand=True)
        for column in ("queue", "mode", "depth P", "depth D", "at D"):
            queues.add_column(column, justify="right" if column.startswith("depth") else "left")
        for name, mode in QUEUES.items():
            p, d = self.sample.queues_p.get(name), self.sample.queues_d.get(name)
            if d is None:
                at_d = "absent"
            elif mode == "full":
                same = p is not None and p["digest"] == d["digest"]
                at_d = "replica, " + ("[green]same digest[/green]" if same else "catching up")
            else:
                at_d = "queue"
            queues.add_row(
                name,
                mode,
                str(p["depth"]) if p else "-",
                str(d["depth"]) if d else "-",
                at_d,
            )
        events = Text("\n".join(self.events[-8:]) or "-")
        return Group(head, sidecars, queues, Panel(events, title="events"))

    # -- sampling -------------------------------------------------------------

    def sampler(self, two: TwoSites) -> None:
        while not self._stop.is_set():
            ports = list(two.metrics_port.items())
            status = {key: fetch_status(port) for key, port in ports}
            for doc in status.values():
                lag = doc.get("lag_seconds")
                if isinstance(lag, (int, float)):
                    self.max_lag_s = max(self.max_lag_s, float(lag))
            queues_p = describe(two.p.amqp[2])
            queues_d = describe(two.d.amqp[2])
            self.sample = Sample(status, queues_p, queues_d)
            self._stop.wait(SAMPLE_INTERVAL_S)

    def active(self, site: str, role: str) -> int | None:
        for (s, node), doc in sorted(self.sample.status.items()):
            if s == site and doc.get("role") == role and doc.get("link_state") == "up":
                return node
        return None

    # -- the run --------------------------------------------------------------

    def run(self) -> DemoResult:
        result = DemoResult()
        workdir = self.options.workdir
        self.console.print(
            f"starting site P and site D (3 brokers + 3 sidecars each, embedded bus, "
            f"WAN {WAN_DELAY_MS} ms one way) ..."
        )
        with TwoSites(delay_ms=WAN_DELAY_MS, metrics=True, workdir=workdir) as two:
            self.console.print(
                f"  up in {time.monotonic() - self.started:.1f} s; work directory {two.workdir}"
            )
            self._declare(two)
            sampler = threading.Thread(target=self.sampler, args=(two,), daemon=True)
            try:
                sampler.start()
                with Live(self.render(), console=self.console, refresh_per_second=4) as live:
                    self._stream(two, live, result)
                    self.phase = "checking invariants"
                    live.update(self.render())
                    self._check(two, live, result)
                    self.phase = "done"
                    live.update(self.render())
            finally:
                self._stop.set()
                for client in self.clients:
                    if client.poll() is None:
                        client.kill()
                    client.wait()
                self.console.print("stopping every process ...")
        result.figures["run time"] = f"{time.monotonic() - self.started:.1f} s"
        result.figures["max lag seen (egress /status)"] = f"{self.max_lag_s:.2f} s"
        return result

    def _declare(self, two: TwoSites) -> None:
        self.console.print("declaring " + ", ".join(f"{q} ({m})" for q, m in QUEUES.items()))
        threads = []
        outcomes: dict[str, subprocess.CompletedProcess[str]] = {}

        def declare(name: str, mode: str) -> None:
            outcomes[name] = two.p.admin(1, "add-queue", name, "--replicate", mode)

        for name, mode in QUEUES.items():
            thread = threading.Thread(target=declare, args=(name, mode))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        for name, done in outcomes.items():
            if done.returncode != 0:
                raise RuntimeError(f"declaring {name} at P failed: {done.stderr.strip()}")

    def _stream(self, two: TwoSites, live: Live, result: DemoResult) -> None:
        rate, count = self.options.rate, self.count
        self.phase = "streaming"
        self.stream_started = time.monotonic()
        self.log(f"publishing {count} messages to each queue at P at {rate:.0f}/s")
        d_consumer = two.d.client_popen(
            2, "consume", two.d.amqp[2], "q-enq", "--count", str(count), "--idle", "60"
        )
        self.clients.append(d_consumer)
        publishers = {
            name: two.p.client_popen(
                1,
                "publish",
                two.p.amqp[1],
                name,
                "--count",
                str(count),
                "--rate",
                str(rate),
                "--stamp",
            )
            for name in QUEUES
        }
        self.clients += publishers.values()
        p_consumer = two.p.client_popen(
            2, "consume", two.p.amqp[2], "q-full", "--count", str(count // 2), "--idle", "60"
        )
        self.clients.append(p_consumer)
        self.log("consuming q-full at P (half of it) and q-enq at D (all of it)")
        halfway = self.stream_started + self.options.duration_s / 2
        killed = False
        while any(p.poll() is None for p in publishers.values()):
            if self.options.kill and not killed and time.monotonic() >= halfway:
                killed = True
                self._kill_egress(two, live, result)
            live.update(self.render())
            time.sleep(0.25)  # the view's refresh pace
        self.phase = "draining"
        for name, publisher in publishers.items():
            outcome = finish_client(publisher)
            result.checks.append(
                Check(
                    f"every publish to {name} accepted at P",
                    outcome["accepted"] == count,
                    f"{outcome['accepted']}/{count} accepted {outcome.get('error', '')}".strip(),
                )
            )
        self.log(f"publishers done after {time.monotonic() - self.stream_started:.1f} s")
        live.update(self.render())
        self._p_consumer, self._d_consumer = p_consumer, d_consumer

    def _kill_egress(self, two: TwoSites, live: Live, result: DemoResult) -> None:
        before = self.active("site-p", "egress") or 1
        name = f"sidecar-{before}"
        self.log(f"SIGKILL of P's active egress {name}")
        killed_at = time.monotonic()
        two.p.kill(name, signal.SIGKILL)
        self.phase = "egress killed, waiting for a standby"

        standbys = {
            node: port
            for (site, node), port in two.metrics_port.items()
            if site == "site-p" and node != before
        }
        new_egress: list[int] = []

        def taken_over() -> bool:
            # Asked directly (not through the sampler) so the time is to ~0.1 s.
            live.update(self.render())
            for node, port in sorted(standbys.items()):
                doc = fetch_status(port)
                if doc.get("role") == "egress" and doc.get("link_state") == "up":
                    new_egress.append(node)
                    return True
            return False

        took = wait_for(taken_over, TAKEOVER_DEADLINE_S, interval=0.1)
        if took is None:
            self.log(f"[red]no standby took over within {TAKEOVER_DEADLINE_S:.0f} s[/red]")
            result.checks.append(Check("a standby takes over the egress", False, "timed out"))
        else:
            took = time.monotonic() - killed_at
            node = new_egress[0]
            self.log(f"sidecar-{node} is the active egress, link up, {took:.2f} s after the kill")
            result.checks.append(
                Check(
                    "a standby takes over the egress",
                    True,
                    f"sidecar-{node} is egress with its link up {took:.2f} s after the kill",
                )
            )
            result.figures["egress takeover"] = f"{took:.2f} s (sidecar-{before} -> {node})"
        self.phase = "streaming"

    def _check(self, two: TwoSites, live: Live, result: DemoResult) -> None:
        count = self.count

        def full_converged() -> bool:
            live.update(self.render())
            p, d = describe(two.p.amqp[2]), describe(two.d.amqp[2])
            return (
                "q-full" in p and "q-full" in d and p["q-full"]["digest"] == d["q-full"]["digest"]
            )

        took = wait_for(full_converged, CONVERGE_DEADLINE_S, interval=0.5)
        p, d = describe(two.p.amqp[2]), describe(two.d.amqp[2])
        p_full, d_full = p.get("q-full", {}), d.get("q-full", {})
        result.checks.append(
            Check(
                "full: D's replica digest == P's queue digest",
                took is not None,
                f"depth P {p_full.get('depth')} / D {d_full.get('depth')}, digest "
                f"{str(d_full.get('digest', '-'))[:12]}",
            )
        )
        consumed = finish_client(self._d_consumer, timeout=CONVERGE_DEADLINE_S + 60)
        ids = consumed["ids"]
        expected = [f"m-{i}" for i in range(1, count + 1)]
        result.checks.append(
            Check(
                "enqueue: D consumed every message once, in order",
                ids == expected,
                f"{len(ids)}/{count} received, {len(ids) - len(set(ids))} duplicates, "
                f"{'in order' if ids == sorted(ids, key=_seq) else 'OUT OF ORDER'}",
            )
        )
        lags = sorted(consumed.get("lags") or [])
        if lags:
            result.figures["q-enq lag P publish -> D consume"] = (
                f"p50 {1000 * statistics.median(lags):.0f} ms, "
                f"p99 {1000 * lags[int(0.99 * (len(lags) - 1))]:.0f} ms, "
                f"max {1000 * lags[-1]:.0f} ms"
            )
        consumed_p = finish_client(self._p_consumer, timeout=30)
        result.figures["q-full consumed at P"] = str(consumed_p["received"])
        d = describe(two.d.amqp[3])  # another D broker: every node holds the same state
        wire = d.get("q-wire")
        result.checks.append(
            Check(
                "wiring: queue exists at D and is empty",
                wire is not None and wire["depth"] == 0,
                "absent" if wire is None else f"depth {wire['depth']}",
            )
        )
        result.checks.append(
            Check(
                "none: queue absent at D",
                "q-none" not in d and bool(d),
                "absent" if "q-none" not in d else "PRESENT",
            )
        )
        self.log("invariants checked")


def _seq(message_id: str) -> int:
    return int(message_id.rsplit("-", 1)[1])


def _num(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "-"


def summary(result: DemoResult) -> Table:
    table = Table(title="drgate demo: summary")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for check in result.checks:
        table.add_row(
            check.name, "[green]PASS[/green]" if check.ok else "[red]FAIL[/red]", check.detail
        )
    for name, value in result.figures.items():
        table.add_row(name, "", value)
    return table


def run_demo(options: DemoOptions, console: Console | None = None) -> int:
    """Run the demo; 0 when every invariant held, 1 otherwise, 130 on Ctrl-C."""
    console = console or Console()
    demo = Demo(options, console)
    try:
        with sigterm_as_interrupt():
            result = demo.run()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every process was stopped[/yellow]")
        return 130
    except SiteError as exc:
        # A lab process failed to start: the message names its log.
        console.print(f"[red]the lab failed:[/red] {exc}")
        return 1
    console.print(summary(result))
    verdict = "all invariants hold" if result.ok else "SOME INVARIANTS FAILED"
    console.print(f"[bold]{verdict}[/bold] ({result.figures.get('run time', '')})")
    return 0 if result.ok else 1
