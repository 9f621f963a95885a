"""End to end: forwarded events/s and lag over a 25 ms one-way WAN, until saturation.

    .venv/bin/python bench/e2e_bench.py                 # embedded bus, loopback, no root
    .venv/bin/python bench/e2e_bench.py --corosync      # also the corosync bus ceiling (root)

Setup: lab.site.TwoSites (3 brokers + 3 sidecars per site, embedded
bus), one WAN emulator per D sidecar with 25 ms one-way delay.  One
``enqueue`` queue is declared at P; D consumes it.

For each offered load (messages/s published at P by paced Proton client
processes, ``publish --rate``, split over several publishers and P's three
brokers), a step publishes ``load x --step`` messages stamped with their send
time (application property ``sent_at``) while one consumer at D takes them
all:

* **delivered/s** (= forwarded events/s end to end): messages received at D
  divided by the time from D's first receipt to its last (so the client
  processes' start-up, about a second each, is not counted);
  ``published/s`` includes the publishers' start-up;
* **lag p50/p99**: per message, D's receive time minus P's send time (one
  machine, one clock).  This is publish at P -> applied at D -> delivered to
  D's consumer, so it bounds "applied at D" from above;
* **egress lag max**: the highest ``lag_seconds`` in the active egress's
  ``/status`` (P's commit time of the oldest unacknowledged event to now),
  sampled every 0.5 s, as a cross-check that the lag is the link's and not
  the consumer's.

A step saturates when delivered/s falls below 90 % of the offered load or the
p99 lag exceeds 5 s; the sweep stops after the first saturated step.

In the same run: the embedded bus's own delivery rate (bench/bus_bench.py's
3-member round, 200-byte payloads, on a sequencer of its own): the ceiling
for the tap, since every command reaches the tap through the bus.  With
``--corosync`` (root) the corosync bus's rate as well.

CPU per message per process (``--cpu``, or ``--cpu-only``): one unpaced burst
of ``--cpu-burst`` messages on fresh sites of 3 and of 1 node(s) per site; the
user + system CPU of every process (bench/proccpu.py, from /proc) over the
messages delivered at D, by role: the P brokers the publishers are connected
to, P's other brokers, the egress, the standby taps, the WAN emulator that
carries the link, the ingress, D's standby sidecars, the D broker serving the
consumer, D's other brokers, and each site's bus.  The client processes are
not counted.  With ``--profile DIR`` and py-spy available (on the PATH or
``PY_SPY=...``) a second burst runs with py-spy recording the egress and the
ingress, and the top functions are printed (and written to DIR).  With
``--cpu-paced 500,1000,2000`` (alone, or with ``--cpu-only``): the same table
for paced loads through one pair of fresh sites of the first ``--cpu-nodes``
size (each load for ``--step`` seconds), with the share of the machine's
cores all processes used and the lag: what a message costs when each one
wakes every process on its way, as at any load below saturation; with
``--profile DIR`` py-spy records the egress, the ingress, one standby of
each site and the brokers at the ends during each step.  Both tables end
with the share of the processes' CPU that was system time (their system
calls).

Metrics cost: one burst of unpaced publishes on fresh sites with
metrics off and on (``TwoSites(metrics=False|True)``); the ratio of delivered/s
on to off.  Target >= 0.95.  One burst each is noisy on a shared machine:
``--bursts`` repeats them alternately and the medians are compared.

A long WAN (``--wan-delays 25,50,100``, nothing else runs): the same unpaced
burst (``--wan-burst`` messages of ``--wan-size`` bytes, 2,000 by default)
through fresh 3 + 3 sites at each one-way delay, the delays alternating over
``--wan-rounds``; delivered/s at D per delay and its ratio to the first
delay's, and the lag above the delay.  The link's window (8 MiB) should make
the delay irrelevant: target >= 0.9 at 100 ms of the 25 ms figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from proccpu import CpuMeter, Profiler, profile_table  # noqa: E402

from lab.site import TwoSites, finish_client  # noqa: E402

LOADS = [50, 100, 200, 500, 1000, 2000, 4000, 8000]
# One paced Proton publisher process sends at most this many messages a second
# here; a load above it is split over several publishers.
PER_PUBLISHER = 750
SATURATED_SHARE = 0.9
SATURATED_P99_S = 5.0
BURST = 4000
CPU_BURST = 8000
QUEUE = "q-enq"


def declare(two: TwoSites, queue: str) -> None:
    done = two.p.admin(1, "add-queue", queue, "--replicate", "enqueue")
    if done.returncode != 0:
        raise RuntimeError(f"declare {queue}: {done.stderr}")
    # D's consumer attaches only once the replica is there.
    deadline = time.monotonic() + 60
    while not any(q["name"] == queue for q in two.d.describe(consumer_node(two))["queues"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{queue} did not reach D in 60 s")
        time.sleep(0.2)  # polling other processes


def egress_lag(two: TwoSites) -> float | None:
    """The active egress's lag_seconds, or None when no P sidecar answers as egress."""
    for (site, _node), port in sorted(two.metrics_port.items()):
        if site != "site-p":
            continue
        try:
            doc = status_doc(f"http://127.0.0.1:{port}/status", timeout=2)
        except OSError:
            continue
        if doc.get("role") == "egress" and isinstance(doc.get("lag_seconds"), (int, float)):
            return float(doc["lag_seconds"])
    return None


def publishers_for(rate: float) -> int:
    """How many publisher processes a step at ``rate``/s starts (0: unpaced)."""
    return max(1, math.ceil(rate / PER_PUBLISHER)) if rate else 2


def step(
    two: TwoSites, queue: str, count: int, rate: float, tag: str, publish_args: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Publish ``count`` messages at ``rate``/s (0: unpaced) at P, consume them
    at D.  ``two`` may be any pair of sites with the same client surface
    (bench/peer_rabbitmq.py passes its RabbitMQ pair)."""
    publishers_n = publishers_for(rate)
    share = count // publishers_n
    at = consumer_node(two)
    consumer = two.d.client_popen(
        at, "consume", two.d.amqp[at], queue, "--count", str(share * publishers_n),
        "--idle", "60", "--credit", "500",
    )  # fmt: skip
    time.sleep(1.0)  # let the consumer attach before the clock starts (it costs ~1 s to start)
    lag_max = 0.0
    stop = threading.Event()

    def sample() -> None:
        nonlocal lag_max
        while not stop.is_set():
            lag = egress_lag(two) if two.metrics else None
            if lag is not None:
                lag_max = max(lag_max, lag)
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.monotonic()
    publishers = []
    for i in range(publishers_n):
        node = publisher_node(two, i)
        argv = ["publish", two.p.amqp[node], queue, "--count", str(share)]
        argv += ["--prefix", f"{tag}{i}", "--stamp", *publish_args]
        if rate:
            argv += ["--rate", str(rate / publishers_n)]
        publishers.append(two.p.client_popen(node, *argv))
    published = [finish_client(p, timeout=600) for p in publishers]
    accepted = sum(r["accepted"] for r in published)
    errors = [r["error"] or r["first_rejection"] for r in published]
    published_s = time.monotonic() - start
    got = finish_client(consumer, timeout=600)
    delivered_s = time.monotonic() - start
    stop.set()
    sampler.join()
    lags = sorted(got["lags"])
    return {
        "offered": rate,
        "published_per_s": accepted / published_s,
        "delivered": len(got["ids"]),
        # D's steady rate: first to last receipt, so the clients' start-up is not in it.
        "delivered_per_s": (len(got["ids"]) - 1) / max(1e-6, got["last_at"] - got["first_at"]),
        "delivered_incl_start_per_s": len(got["ids"]) / delivered_s,
        "p50_ms": 1000 * statistics.median(lags) if lags else float("nan"),
        "p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else float("nan"),
        "egress_lag_max_s": lag_max,
        "publishers": publishers_n,
        "errors": [r for r in (got.get("error"), *errors) if r],
    }


def consumer_node(two: TwoSites) -> int:
    """D's node the consumer attaches to: node 2 (node 1 on a one-node site)."""
    return two.nodes[min(1, len(two.nodes) - 1)]


def publisher_node(two: TwoSites, i: int) -> int:
    """P's node publisher ``i`` sends to."""
    return two.nodes[i % len(two.nodes)]


def status_doc(url: str, timeout: float = 5) -> dict[str, Any]:
    """A sidecar's ``/status`` document."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        doc: dict[str, Any] = json.load(r)
    return doc


def sidecar_role(two: TwoSites, cluster: str, n: int) -> str:
    return str(status_doc(two.status_url(cluster, n)).get("role"))


# The process roles of the CPU table, in the order printed.
CPU_ROLES = [
    "P broker receiving the publishes",
    "P broker, apply only",
    "P egress sidecar",
    "P standby tap",
    "WAN emulator (all)",
    "D ingress sidecar",
    "D standby sidecar",
    "D broker serving the consumer",
    "D broker, apply only",
    "P bus",
    "D bus",
]


def process_roles(two: TwoSites, publishers: int = 2) -> dict[str, tuple[str, int]]:
    """Every process of the two sites: its label -> (role, pid), with
    ``publishers`` publisher processes running."""
    publishing = {publisher_node(two, i) for i in range(publishers)}
    roles: dict[str, tuple[str, int]] = {}
    for site, tag in ((two.p, "P"), (two.d, "D")):
        for name, proc in site.procs.items():
            if name == "bus":
                role = f"{tag} bus"
            elif name.startswith("wan-"):
                role = "WAN emulator (all)"
            elif name.startswith("broker-"):
                n = int(name.split("-")[1])
                if tag == "P":
                    role = CPU_ROLES[0] if n in publishing else CPU_ROLES[1]
                else:
                    role = CPU_ROLES[7] if n == consumer_node(two) else CPU_ROLES[8]
            else:
                live = sidecar_role(two, site.cluster, int(name.split("-")[1]))
                role = {
                    "egress": CPU_ROLES[2],
                    "standby": CPU_ROLES[3],
                    "ingress": CPU_ROLES[5],
                    "ingress-standby": CPU_ROLES[6],
                }.get(live, f"{tag} sidecar ({live})")
            roles[f"{tag}:{name}"] = (role, proc.pid)
    return roles


def cpu_burst(
    workdir: Path, nodes: int, count: int, profile: Path | None, size: int = 0
) -> dict[str, Any]:
    """One unpaced burst of ``count`` on fresh sites of ``nodes`` per site:
    delivered/s and µs CPU per delivered message of each process role;
    with ``profile``, py-spy records the egress and the ingress meanwhile."""
    label = f"cpu-{nodes}{'-profile' if profile else ''}"
    with TwoSites(nodes=nodes, delay_ms=25, metrics=True, workdir=workdir / label) as two:
        declare(two, QUEUE)
        roles = process_roles(two)
        meter = CpuMeter({name: pid for name, (_role, pid) in roles.items()})
        profiler = None
        if profile is not None:
            # The two gateway halves, and for comparison the brokers at the ends.
            names = {
                CPU_ROLES[2]: "egress",
                CPU_ROLES[5]: "ingress",
                CPU_ROLES[0]: "P broker receiving the publishes",
                CPU_ROLES[7]: "D broker serving the consumer",
            }
            profiler = Profiler(profiled_roles(roles, names), profile / f"{nodes}-node")
            if not profiler.start():
                profiler = None
        meter.start()
        result = step(two, QUEUE, count, 0, "c", ("--size", str(size)) if size else ())
        spent = meter.stop()
        files = profiler.stop() if profiler is not None else {}
    if result["delivered"] < count:
        raise RuntimeError(
            f"the CPU burst delivered {result['delivered']} of {count} at D: "
            f"{result['errors']}; logs in {workdir / label}"
        )
    return {
        "nodes": nodes,
        "delivered": result["delivered"],
        "delivered_per_s": result["delivered_per_s"],
        **per_message(spent, meter, roles, result["delivered"]),
        "profiles": files,
    }


# What a paced step profiles: below saturation each process's cost is its
# wake-ups, and a standby shows what every bus member pays for one.
PACED_PROFILED = {
    CPU_ROLES[0]: "P broker receiving the publishes",
    CPU_ROLES[2]: "egress",
    CPU_ROLES[3]: "P standby tap",
    CPU_ROLES[5]: "ingress",
    CPU_ROLES[6]: "D standby sidecar",
    CPU_ROLES[7]: "D broker serving the consumer",
}


def profiled_roles(roles: dict[str, tuple[str, int]], names: dict[str, str]) -> dict[str, int]:
    """The pid of one process of each role in ``names`` (role: profile name)."""
    return {names[role]: pid for role, pid in roles.values() if role in names}


def per_message(
    spent: dict[str, float], meter: CpuMeter, roles: dict[str, tuple[str, int]], delivered: int
) -> dict[str, Any]:
    """µs of CPU per delivered message of each process (``spent``: seconds
    by process name) and its wake-ups per message (``meter.wakeups``),
    grouped by role, and their sums."""
    by_role: dict[str, list[float]] = {}
    wakeups: dict[str, list[float]] = {}
    messages = max(1, delivered)
    for name, seconds in spent.items():
        by_role.setdefault(roles[name][0], []).append(1e6 * seconds / messages)
        wakeups.setdefault(roles[name][0], []).append(meter.wakeups[name] / messages)
    return {
        "us_per_message": by_role,
        "total_us": sum(sum(v) for v in by_role.values()),
        "wakeups_per_message": wakeups,
        "total_wakeups": sum(sum(v) for v in wakeups.values()),
        "kernel_share": meter.kernel_share(spent),
    }


def cpu_paced(
    workdir: Path,
    nodes: int,
    loads: list[int],
    step_s: float,
    spool_fsync: str = "never",
    profile: Path | None = None,
) -> list[dict[str, Any]]:
    """µs CPU per delivered message of each process role at each paced
    load (``step_s`` seconds each) through one pair of fresh sites, with the
    share of the machine's cores all processes used over the step; the
    sidecars' spools with ``spool_fsync``.  With ``profile``, py-spy records
    the processes of :data:`PACED_PROFILED` meanwhile (the tables are
    printed and written to ``profile``)."""
    results = []
    with TwoSites(
        nodes=nodes,
        delay_ms=25,
        metrics=True,
        workdir=workdir / "cpu-paced",
        spool_fsync=spool_fsync,
    ) as two:
        declare(two, QUEUE)
        for load in loads:
            print(f"CPU at {load} msgs/s offered, {nodes} node(s) per site ...", flush=True)
            roles = process_roles(two, publishers_for(load))
            meter = CpuMeter({name: pid for name, (_role, pid) in roles.items()})
            profiler = None
            if profile is not None:
                profiler = Profiler(profiled_roles(roles, PACED_PROFILED), profile / f"{load}")
                if not profiler.start():
                    print("  no profile: py-spy not found (PATH or PY_SPY=...)")
                    profiler = None
            start = time.monotonic()
            meter.start()
            result = step(two, QUEUE, int(load * step_s), load, f"cp{load}-")
            spent = meter.stop()
            elapsed = time.monotonic() - start
            if profiler is not None:
                for name, path in sorted(profiler.stop().items()):
                    table = profile_table(f"{name}, {load}/s offered", path)
                    (profile / f"{name.replace(' ', '-')}-{load}.md").write_text(table + "\n")
                    print("\n" + table)
            results.append(
                {
                    "label": f"{load}/s offered",
                    "delivered_per_s": result["delivered_per_s"],
                    **per_message(spent, meter, roles, result["delivered"]),
                    "cores": sum(spent.values()) / elapsed,
                    "p50_ms": result["p50_ms"],
                    "p99_ms": result["p99_ms"],
                }
            )
    return results


def print_cpu(results: list[dict[str, Any]]) -> None:
    """The µs CPU per message table, one column per site size (or load),
    then the wake-ups per message of the same processes."""
    header = f"{'process role (µs CPU / message delivered at D)':<46}"
    columns = "".join(
        f"{r.get('label', str(r.get('nodes')) + ' node(s)/site'):>26}" for r in results
    )
    print("\n" + header + columns)
    _role_rows(results, "us_per_message", "", "{:.0f}")
    print(f"{'all processes':<46}" + "".join(f"{r['total_us']:>26.0f}" for r in results))
    print(
        f"{'of which in the kernel (system time)':<46}"
        + "".join(f"{100 * r['kernel_share']:>25.0f}%" for r in results)
    )
    paced = all("cores" in r for r in results)
    print(
        f"{'delivered/s at D' if paced else 'burst delivered/s at D':<46}"
        + "".join(f"{r['delivered_per_s']:>26.0f}" for r in results)
    )
    if paced:
        cores = os.cpu_count() or 1
        print(
            f"{f'cores busy, all processes (of {cores})':<46}"
            + "".join(f"{r['cores']:>26.2f}" for r in results)
        )
        print(
            f"{'lag p50 / p99 (ms)':<46}"
            + "".join(f"{r['p50_ms']:>17.0f} / {r['p99_ms']:>4.0f}" for r in results)
        )
    # Each a wait for a socket or a timer that ended: how many messages a
    # turn of each process finds (docs/performance.md, eleventh round).
    print("\n" + f"{'process role (wake-ups / message at D)':<46}" + columns)
    _role_rows(results, "wakeups_per_message", ", wake-ups", "{:.2f}")
    print(
        f"{'all processes, wake-ups':<46}"
        + "".join(f"{r['total_wakeups']:>26.1f}" for r in results)
    )


def _role_rows(results: list[dict[str, Any]], key: str, suffix: str, form: str) -> None:
    """One row per process role of ``results[i][key]`` (role: a value per
    process), each label with ``suffix``, each value formatted by ``form``."""
    roles = list(CPU_ROLES)
    for r in results:
        roles += [k for k in r[key] if k not in roles]
    for role in roles:
        cells = []
        for r in results:
            values = r[key].get(role)
            if not values:
                cells.append("—")
            elif len(values) == 1:
                cells.append(form.format(values[0]))
            else:
                cells.append(" / ".join(form.format(v) for v in sorted(values)) + " each")
        print(f"{role + suffix:<46}" + "".join(f"{c:>26}" for c in cells))


def bus_ceiling(backend: str, count: int) -> float:
    """Messages/s of a 3-member bus round (200 B), as bench/bus_bench.py measures it."""
    import bus_bench

    if backend == "embedded":
        with bus_bench.open_sequencer("e2e-ceiling") as (address, key_file):
            argvs = [
                bus_bench.member_argv(
                    "embedded", "e2e-ceiling", n, 200, count, n == 1, address, key_file
                )
                for n in (1, 2, 3)
            ]
            return count / bus_bench.run_round(argvs)
    from lab.netns import CorosyncSite

    with CorosyncSite("e2eceil", nodes=3, subnet="10.213.31", prefix="dgE") as site:
        argvs = [
            site.ns_argv(n, bus_bench.member_argv("corosync", "e2e", n, 200, count, n == 1, None))
            for n in (1, 2, 3)
        ]
        return count / bus_bench.run_round(argvs)


def burst(workdir: Path, metrics: bool, label: str) -> float:
    with TwoSites(delay_ms=25, metrics=metrics, workdir=workdir / label) as two:
        declare(two, QUEUE)
        result = step(two, QUEUE, BURST, 0, "b")
        print(
            f"  burst metrics={'on' if metrics else 'off'}: {result['delivered_per_s']:.0f}/s",
            flush=True,
        )
        return float(result["delivered_per_s"])


def resync_rate(workdir: Path, count: int) -> dict[str, float]:
    """Seed an empty D from a P holding ``count`` messages in a ``full`` queue:
    messages/s and MB/s of the resync, from the link up to D's ack of the
    resync's commit (P's egress ``/status``), then D's replica checked equal
    to P's queue (digests).  The egress retries an absent D at its backoff,
    up to 7.5 s with the jitter: timed from D's sidecars' start, a run
    measured that wait as much as the resync."""
    two = TwoSites(delay_ms=25, metrics=True, workdir=workdir / "resync")
    try:
        two.start_p_first()  # D's sidecars only once P is loaded
        done = two.p.admin(1, "add-queue", "q-full", "--replicate", "full")
        if done.returncode != 0:
            raise RuntimeError(f"declare q-full: {done.stderr}")
        share = count // 3
        publishers = [
            two.p.client_popen(
                n, "publish", two.p.amqp[n], "q-full", "--count", str(share),
                "--start", str(1 + (n - 1) * share), "--size", "200",
            )
            for n in two.nodes
        ]  # fmt: skip
        for publisher in publishers:
            finish_client(publisher, timeout=1200)
        egress = next(n for n in two.nodes if sidecar_role(two, "site-p", n) == "egress")
        url = two.status_url("site-p", egress)

        def wait(what: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
            deadline = time.monotonic() + 600
            while not done(doc := status_doc(url)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the resync bench waited 10 minutes for {what}")
                time.sleep(0.02)  # polling another process
            return doc

        two.start_d_sidecars()
        wait("the link to D", lambda doc: doc["link_state"] == "up")
        started = time.monotonic()
        resync = wait(
            "D's ack of the resync",
            lambda doc: doc["resync"]["total"] >= 1 and not doc["resync"]["active"],
        )["resync"]
        took = time.monotonic() - started

        def digest(site: Any) -> str | None:
            for q in site.describe(2)["queues"]:
                if q["name"] == "q-full":
                    return str(q["digest"])
            return None

        if digest(two.d) != digest(two.p):
            raise RuntimeError("after the resync, D's replica of q-full differs from P's queue")
        return {
            "messages": float(3 * share),
            "seconds": took,
            "per_s": 3 * share / took,
            "mb_per_s": float(resync.get("bytes_total") or 0) / took / 1e6,
        }
    finally:
        two.stop()


def run_cpu(workdir: Path, args: argparse.Namespace) -> None:
    sizes = [int(n) for n in args.cpu_nodes.split(",")]
    if args.cpu_paced:
        loads = [int(x) for x in args.cpu_paced.split(",")]
        print_cpu(cpu_paced(workdir, sizes[0], loads, args.step, args.spool_fsync, args.profile))
        return
    results = []
    for nodes in sizes:
        print(f"CPU burst of {args.cpu_burst}, {nodes} node(s) per site ...", flush=True)
        results.append(cpu_burst(workdir, nodes, args.cpu_burst, None, args.cpu_size))
    print_cpu(results)
    if args.profile is None:
        return
    for nodes in sizes:
        print(f"\nprofile burst, {nodes} node(s) per site (py-spy) ...", flush=True)
        done = cpu_burst(workdir, nodes, args.cpu_burst, args.profile, args.cpu_size)
        if not done["profiles"]:
            print("  no profile: py-spy not found (PATH or PY_SPY=...)")
            return
        for half, path in sorted(done["profiles"].items()):
            table = profile_table(f"{half}, {nodes} node(s) per site", path)
            (args.profile / f"{half.replace(' ', '-')}-{nodes}-node.md").write_text(table + "\n")
            print("\n" + table)


def wan_delays(workdir: Path, delays: list[int], count: int, size: int, rounds: int) -> None:
    """Issue 18, item 4: the same unpaced burst of ``count`` messages of
    ``size`` bytes through fresh 3 + 3 sites at each one-way delay, in one
    run, the delays alternating over ``rounds``; delivered/s at D (its first
    to last receipt), its median per delay and its ratio to the first delay's,
    and the lag above the delay."""
    runs: dict[int, list[dict[str, Any]]] = {d: [] for d in delays}
    for r in range(rounds):
        for delay in delays:
            label = f"wan-{delay}ms-{r}"
            with TwoSites(delay_ms=delay, metrics=True, workdir=workdir / label) as two:
                declare(two, QUEUE)
                result = step(two, QUEUE, count, 0, f"w{delay}-", ("--size", str(size)))
            if result["delivered"] < count:
                raise RuntimeError(
                    f"{delay} ms: {result['delivered']} of {count} delivered at D: "
                    f"{result['errors']}; logs in {workdir / label}"
                )
            runs[delay].append(result)
            print(
                f"  {delay} ms one way, round {r + 1}: {result['delivered_per_s']:.0f}/s, "
                f"lag p50 {result['p50_ms']:.0f} ms, p99 {result['p99_ms']:.0f} ms",
                flush=True,
            )
    base = statistics.median(x["delivered_per_s"] for x in runs[delays[0]])
    print(
        f"\n{'one-way delay':>14} {'delivered/s':>12} {'ratio':>6} "
        f"{'lag p50 - delay':>16} {'lag p99 - delay':>16}"
    )
    for delay in delays:
        rate = statistics.median(x["delivered_per_s"] for x in runs[delay])
        p50 = statistics.median(x["p50_ms"] for x in runs[delay]) - delay
        p99 = statistics.median(x["p99_ms"] for x in runs[delay]) - delay
        print(f"{delay:>11} ms {rate:>12.0f} {rate / base:>6.2f} {p50:>13.0f} ms {p99:>13.0f} ms")
    print(
        f"(median of {rounds} burst(s) of {count} x {size} B per delay; "
        f"target: {delays[-1]} ms >= 0.9 x {delays[0]} ms)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--step", type=float, default=8.0, help="seconds per load step")
    parser.add_argument("--loads", default=",".join(map(str, LOADS)))
    parser.add_argument("--bursts", type=int, default=1, help="metrics on/off bursts each")
    parser.add_argument("--corosync", action="store_true", help="also the corosync bus (root)")
    parser.add_argument(
        "--resync", type=int, default=100_000, help="messages queued at P for the resync rate"
    )
    parser.add_argument("--cpu", action="store_true", help="also CPU per message per process")
    parser.add_argument("--cpu-only", action="store_true", help="only the CPU bursts")
    parser.add_argument("--cpu-burst", type=int, default=CPU_BURST)
    parser.add_argument("--cpu-nodes", default="3,1", help="site sizes of the CPU bursts")
    parser.add_argument("--cpu-size", type=int, default=0, help="message bytes (0: ~10)")
    parser.add_argument(
        "--spool-fsync",
        choices=("never", "batch", "always"),
        default="never",
        help="the sidecars' spool.fsync in --cpu-paced (the lab's never by default)",
    )
    parser.add_argument(
        "--cpu-paced", default=None, help="only CPU per message at these paced loads, e.g. 500,1000"
    )
    parser.add_argument(
        "--profile", type=Path, default=None, help="py-spy egress, ingress, end brokers into DIR"
    )
    parser.add_argument(
        "--wan-delays",
        default=None,
        help="only compare bursts at these one-way delays in ms, e.g. 25,50,100",
    )
    parser.add_argument("--wan-burst", type=int, default=BURST)
    parser.add_argument("--wan-size", type=int, default=2000, help="message bytes (WAN mode)")
    parser.add_argument("--wan-rounds", type=int, default=2)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="e2e-bench-"))
    if args.wan_delays:
        delays = [int(d) for d in args.wan_delays.split(",")]
        print(f"bursts at {delays} ms one way ...", flush=True)
        wan_delays(workdir, delays, args.wan_burst, args.wan_size, args.wan_rounds)
        return 0
    if args.cpu or args.cpu_only or args.cpu_paced:
        run_cpu(workdir, args)
        if args.cpu_only or args.cpu_paced:
            return 0

    print("embedded bus ceiling (3 members, 200 B) ...", flush=True)
    ceiling = {"embedded": bus_ceiling("embedded", 20000)}
    if args.corosync:
        from lab.netns import lab_unavailable_reason

        reason = lab_unavailable_reason()
        if reason is None:
            print("corosync bus ceiling ...", flush=True)
            ceiling["corosync"] = bus_ceiling("corosync", 20000)
        else:
            print(f"corosync part skipped: {reason}", flush=True)

    print("metrics cost: bursts on fresh sites ...", flush=True)
    off, on = [], []
    for i in range(args.bursts):
        off.append(burst(workdir, False, f"off-{i}"))
        on.append(burst(workdir, True, f"on-{i}"))

    rows = []
    print("load sweep (25 ms one-way WAN) ...", flush=True)
    with TwoSites(delay_ms=25, metrics=True, workdir=workdir / "sweep") as two:
        declare(two, QUEUE)
        for load in (int(x) for x in args.loads.split(",")):
            result = step(two, QUEUE, int(load * args.step), load, f"l{load}-")
            rows.append(result)
            print(
                f"  offered {load}/s: delivered {result['delivered_per_s']:.0f}/s, "
                f"p99 {result['p99_ms']:.0f} ms",
                flush=True,
            )
            saturated = (
                result["delivered_per_s"] < SATURATED_SHARE * load
                or result["p99_ms"] > 1000 * SATURATED_P99_S
            )
            if saturated:
                break

    print(
        f"\n{'offered/s':>10} {'published/s':>12} {'delivered/s':>12} "
        f"{'lag p50 ms':>11} {'lag p99 ms':>11} {'egress lag max s':>17}"
    )
    for r in rows:
        print(
            f"{r['offered']:>10.0f} {r['published_per_s']:>12.0f} {r['delivered_per_s']:>12.0f} "
            f"{r['p50_ms']:>11.0f} {r['p99_ms']:>11.0f} {r['egress_lag_max_s']:>17.2f}"
        )
    for backend, rate in ceiling.items():
        print(f"{backend} bus ceiling (3 members, 200 B, same run): {rate:.0f} msgs/s")
    off_m, on_m = statistics.median(off), statistics.median(on)
    print(
        f"metrics cost: delivered/s on {on_m:.0f} / off {off_m:.0f} = ratio {on_m / off_m:.3f} "
        f"(target >= 0.95; {args.bursts} burst(s) of {BURST} each)"
    )
    if args.resync:
        print(f"resync of {args.resync} queued messages ...", flush=True)
        r = resync_rate(workdir, args.resync)
        steady = max(on_m, off_m)
        print(
            f"resync: {r['messages']:.0f} messages in {r['seconds']:.1f} s = {r['per_s']:.0f} "
            f"msgs/s, {r['mb_per_s']:.2f} MB/s on the link; steady streaming (unpaced burst, "
            f"same run) {steady:.0f} msgs/s; ratio {r['per_s'] / steady:.1f} (target >= 3)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
