"""Broker throughput through one node: a 3-node site against a single-member site,
and durable brokers against memory-only ones.

    .venv/bin/python bench/broker_bench.py             # embedded bus; corosync too when root
    .venv/bin/python bench/broker_bench.py --durable   # journals (fsync: batch) against none

For each bus backend (``embedded`` always; ``corosync`` when this process is
root and corosync is installed, in network namespaces via
:class:`lab.netns.CorosyncSite`) and for each site size (3 brokers,
then 1), the benchmark starts a site (lab/site.py), declares a queue
and times Proton client processes (lab/client.py, Container API, up
to 100 unsettled messages in flight):

* publish: COUNT messages to the queue through node 1, each settled by the
  broker only after its command came back on the site bus;
* consume: the same COUNT messages from node 1, each accepted (an accept is
  one more bus command: the dequeue is replicated too).

A client process's start (interpreter, imports, connect, attach) is not
message throughput, so each measurement is preceded by a warm-up run of
WARMUP messages with the same client; "net" subtracts that run's wall time
from the big run's (``COUNT - WARMUP`` messages over ``t_big - t_warm``).
"raw" is COUNT over the whole wall time, start included.  "ratio" is the
3-node net rate over the single-member net rate of the same backend: the
cost of replicating every command to two more members.

``--durable`` compares, for each backend, a 3-node site whose brokers keep
journals (``BrokerSite(durable=True)``, ``fsync: batch``) with a memory-only
one, in the same run: 1 and then 4 publisher clients on node 1, each
publishing COUNT messages marked durable (``publish --durable``) with at most
CREDIT unsettled (``--window``); a durable publish is settled only after the
fdatasync that covers it on node 1.  Net rates as above (the warm-up run has
the same number of clients); both sites run side by side and their runs
alternate, ``--rounds`` of each (3), the best one counting: other processes on
a shared machine only ever slow a run down.  The journals live under ``--dir`` (default
/var/tmp, not a tmpfs): the filesystem it is on is printed, and a tmpfs is
refused, since its fdatasync costs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lab.netns import CorosyncSite, lab_unavailable_reason  # noqa: E402
from lab.site import BrokerSite, finish_client  # noqa: E402

COUNT = 5000
WARMUP = 10
SIZE = 200
CREDIT = 100
QUEUE = "bench"
CLIENTS = (1, 4)


@dataclass
class Rate:
    count: int
    seconds: float
    warm_seconds: float
    warm_count: int = WARMUP

    @property
    def raw(self) -> float:
        return self.count / self.seconds

    @property
    def net(self) -> float:
        # COUNT - WARMUP messages took (t_big - t_warm) beyond what the
        # warm-up run (start, connect, WARMUP messages, close) took.
        extra = self.seconds - self.warm_seconds
        return (self.count - self.warm_count) / extra if extra > 0 else float("inf")


def timed_client(site: BrokerSite, node: int, *args: str) -> tuple[float, dict[str, object]]:
    start = time.perf_counter()
    result = site.client(node, *args, timeout=600)
    return time.perf_counter() - start, result


def publish(site: BrokerSite, count: int, prefix: str) -> float:
    seconds, result = timed_client(
        site, 1, "publish", site.amqp[1], QUEUE, "--count", str(count),
        "--prefix", prefix, "--size", str(SIZE),
    )  # fmt: skip
    if result.get("accepted") != count:
        raise SystemExit(f"publish of {count} failed: {result}")
    return seconds


def consume(site: BrokerSite, count: int) -> float:
    # --idle is only the fallback stop; the client closes at --count.
    seconds, result = timed_client(
        site, 1, "consume", site.amqp[1], QUEUE, "--count", str(count),
        "--idle", "60", "--credit", str(CREDIT),
    )  # fmt: skip
    if result.get("received") != count or result.get("error"):
        raise SystemExit(f"consume of {count} failed: {result.get('error')!r}")
    return seconds


def measure(site: BrokerSite, count: int) -> tuple[Rate, Rate]:
    done = site.admin(1, "add-queue", QUEUE, "--replicate", "full")
    if done.returncode != 0:
        raise SystemExit(f"add-queue failed: {done.stdout}{done.stderr}")
    warm_pub = publish(site, WARMUP, "w")
    warm_con = consume(site, WARMUP)
    pub = publish(site, count, "m")
    con = consume(site, count)
    return Rate(count, pub, warm_pub), Rate(count, con, warm_con)


@contextlib.contextmanager
def site_on(
    backend: str, nodes: int, workdir: Path, *, durable: bool = False
) -> Iterator[BrokerSite]:
    if backend == "embedded":
        with BrokerSite("bench", nodes=nodes, workdir=workdir, durable=durable) as site:
            yield site
        return
    # One corosync node per broker: the single-member site is a one-node ring;
    # the durable site runs beside the memory-only one (--durable).
    subnet, prefix = ("10.213.11", "dgR") if nodes > 1 else ("10.213.12", "dgS")
    if durable:
        subnet, prefix = "10.213.13", "dgT"
    with (
        CorosyncSite(f"bench{nodes}", nodes=nodes, subnet=subnet, prefix=prefix) as lab,
        BrokerSite(
            "bench", nodes=nodes, backend="corosync", corosync=lab, workdir=workdir, durable=durable
        ) as site,
    ):
        yield site


def corosync_reason() -> str | None:
    import ctypes.util

    reason = lab_unavailable_reason()
    if reason is None and ctypes.util.find_library("cpg") is None:
        reason = "libcpg is not installed"
    return reason


def publish_clients(
    site: BrokerSite, clients: int, count: int, prefix: str, *, durable: bool
) -> float:
    """Wall time of ``clients`` publishers of ``count`` messages each on node
    1, started together, CREDIT in flight each."""
    flags = ["--window", str(CREDIT), *(["--durable"] if durable else [])]
    start = time.perf_counter()
    argv = ["publish", site.amqp[1], QUEUE, "--count", str(count), "--size", str(SIZE), *flags]
    popens = [site.client_popen(1, *argv, "--prefix", f"{prefix}{i}") for i in range(clients)]
    results = [finish_client(p, timeout=600) for p in popens]
    seconds = time.perf_counter() - start
    for result in results:
        if result.get("accepted") != count:
            raise SystemExit(f"publish of {count} failed: {result}")
    return seconds


def measure_publish(site: BrokerSite, clients: int, count: int, *, durable: bool) -> Rate:
    warm = publish_clients(site, clients, WARMUP, f"w{clients}-", durable=durable)
    big = publish_clients(site, clients, count, f"m{clients}-", durable=durable)
    # Empty the queue between runs: each run starts from the same state.
    done = site.admin(1, "purge", QUEUE)
    if done.returncode != 0:
        raise SystemExit(f"purge failed: {done.stdout}{done.stderr}")
    return Rate(clients * count, big, warm, clients * WARMUP)


def declare(site: BrokerSite) -> None:
    # Durable, so that durable messages are persistent (journaled whole and
    # settled after the commit); on the memory-only site the flag changes nothing.
    done = site.admin(1, "add-queue", QUEUE, "--replicate", "full", "--durable")
    if done.returncode != 0:
        raise SystemExit(f"add-queue failed: {done.stdout}{done.stderr}")


def filesystem_of(path: Path) -> tuple[str, str]:
    """(description, type) of the filesystem ``path`` is on, from ``df``."""
    done = subprocess.run(
        ["df", "--output=source,fstype,target", str(path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    source, fstype, target = done.stdout.splitlines()[-1].split()
    return f"{fstype} on {source} (mounted on {target})", fstype


def compare_durable(backends: list[str], count: int, rounds: int, directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    where, fstype = filesystem_of(directory)
    if fstype in ("tmpfs", "ramfs"):
        raise SystemExit(
            f"--dir {directory} is on {where}: an fdatasync there costs nothing. "
            "Fix: give --dir a directory on a real disk (e.g. /var/tmp)."
        )
    rates: dict[tuple[str, bool, int], Rate] = {}
    with tempfile.TemporaryDirectory(prefix="broker-bench-", dir=directory) as tmp:
        print(f"journals in {tmp}: {where}", flush=True)
        for backend in backends:
            with contextlib.ExitStack() as stack:
                sites = {
                    durable: stack.enter_context(
                        site_on(backend, 3, Path(tmp) / f"{backend}-{durable}", durable=durable)
                    )
                    for durable in (False, True)
                }
                for site in sites.values():
                    declare(site)
                for clients in CLIENTS:
                    # Alternate the two sites and keep each one's best run:
                    # other processes on the machine slow runs, never speed them.
                    for _ in range(rounds):
                        for durable, site in sites.items():
                            rate = measure_publish(site, clients, count, durable=durable)
                            best = rates.get((backend, durable, clients))
                            if best is None or rate.net > best.net:
                                rates[(backend, durable, clients)] = rate
                            print(
                                f"{backend} {'durable' if durable else 'memory '} {clients} "
                                f"client(s): publish {rate.net:,.0f}/s net ({rate.seconds:.2f} "
                                f"s, warm-up {rate.warm_seconds:.2f} s)",
                                flush=True,
                            )
    print()
    print(
        f"{count} messages of {SIZE} B per client through node 1 of 3, at most {CREDIT} "
        f"in flight per client, best of {rounds} runs, {os.cpu_count()} cores; journals "
        f"(fsync: batch) on {where}; settled publishes/s"
    )
    header = (
        f"| {'backend':<9}| {'clients':>7} | {'memory net':>11} | {'durable net':>11} "
        f"| {'durable/memory':>14} | {'memory raw':>11} | {'durable raw':>11} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for backend in backends:
        for clients in CLIENTS:
            a, b = rates[(backend, False, clients)], rates[(backend, True, clients)]
            print(
                f"| {backend:<9}| {clients:>7} | {a.net:>11,.0f} | {b.net:>11,.0f} "
                f"| {b.net / a.net:>14.2f} | {a.raw:>11,.0f} | {b.raw:>11,.0f} |"
            )
    return 0


def compare_sizes(backends: list[str], count: int) -> int:
    results: dict[tuple[str, int], tuple[Rate, Rate]] = {}
    with tempfile.TemporaryDirectory(prefix="broker-bench-") as tmp:
        for backend in backends:
            for nodes in (3, 1):
                workdir = Path(tmp) / f"{backend}-{nodes}"
                with site_on(backend, nodes, workdir) as site:
                    results[(backend, nodes)] = measure(site, count)
                pub, con = results[(backend, nodes)]
                print(
                    f"{backend} {nodes} node(s): publish {pub.net:,.0f}/s net "
                    f"({pub.seconds:.2f} s, warm-up {pub.warm_seconds:.2f} s), "
                    f"consume {con.net:,.0f}/s net ({con.seconds:.2f} s, "
                    f"warm-up {con.warm_seconds:.2f} s)",
                    flush=True,
                )
    print()
    print(
        f"{count} messages of {SIZE} B through node 1, credit {CREDIT}, "
        f"{os.cpu_count()} cores; msg/s"
    )
    header = (
        f"| {'backend':<9}| {'op':<8}| {'3 nodes net':>12} | {'1 node net':>11} "
        f"| {'ratio 3/1':>9} | {'3 nodes raw':>12} | {'1 node raw':>11} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for backend in backends:
        three, one = results[(backend, 3)], results[(backend, 1)]
        for op, i in (("publish", 0), ("consume", 1)):
            a, b = three[i], one[i]
            print(
                f"| {backend:<9}| {op:<8}| {a.net:>12,.0f} | {b.net:>11,.0f} "
                f"| {a.net / b.net:>9.2f} | {a.raw:>12,.0f} | {b.raw:>11,.0f} |"
            )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=COUNT)
    parser.add_argument("--backend", action="append", choices=["embedded", "corosync"])
    parser.add_argument(
        "--durable", action="store_true", help="durable brokers against memory-only ones"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="--durable: runs of each, the best one counts"
    )
    parser.add_argument(
        "--dir", type=Path, default=Path("/var/tmp"), help="where --durable keeps the journals"
    )
    args = parser.parse_args()
    backends = args.backend or ["embedded", "corosync"]
    if "corosync" in backends and (reason := corosync_reason()) is not None:
        print(f"corosync skipped: {reason}")
        backends.remove("corosync")
    if args.durable:
        return compare_durable(backends, args.count, args.rounds, args.dir)
    return compare_sizes(backends, args.count)


if __name__ == "__main__":
    sys.exit(main())
