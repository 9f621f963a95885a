"""Resync of a big primary: its rate, and what it costs the egress's and the ingress's memory.

    .venv/bin/python bench/resync_bench.py                       # 512 MiB: 2 x 262,144 of 1 KiB
    .venv/bin/python bench/resync_bench.py --messages 20000      # a quick look
    .venv/bin/python bench/resync_bench.py --switch 200000       # also a rules switch of 200,000
    make bench-resync                                            # the 512 MiB run and the switch

Setup: lab.site.TwoSites, ``--nodes`` brokers and sidecars per site (default
1: the egress and the ingress are then the only sidecars, and the machine
holds every copy of the data at once), embedded bus, no WAN delay.  P is
loaded first with ``--messages`` messages of ``--size`` bytes in each of a
``full`` and an ``enqueue`` queue, then D's sidecars start: D applied nothing
of P's incarnation, so P's egress sends one resync snapshot cut at its cseq.

Printed:

* **rate**: snapshot bytes and messages over the time from D's sidecar start
  to D's ``full`` replica digest equal to P's and D's ``enqueue`` queue
  holding every message (so it includes the ingress's start and join);
* **egress peak over steady**: the egress sidecar's peak RSS during the resync
  (``VmHWM``, reset through ``/proc/PID/clear_refs`` just before D starts)
  minus its RSS just before (it already holds P's state: its steady state);
* **ingress peak over steady**: the ingress's ``VmHWM`` minus its RSS once the
  resync is in and the process has settled (it then holds D's replicas: its
  steady state).  The issue's bound for both is 256 MiB.

With ``--switch N``: a queue at P holding N messages under mode ``none`` is
switched to ``full`` (``drgate admin add-queue --replicate full``), and the
time until D's copy equals P's is printed (it goes by a resync: more messages
than one event carries).

Figures, this machine (2 cores), 1 node per site, messages of 1 KiB
(``make bench-resync``):

    P loaded with 2 x 262,144 in 110 s
    resync of 524,288 messages of 1024 B (565 MiB of snapshot) in 35.0 s:
        16.2 MB/s, 14,979 messages/s
      egress:  steady 893 MiB, peak 901 MiB, peak over steady +8 MiB
      ingress: steady 908 MiB, peak 941 MiB, peak over steady +33 MiB
    rules switch of a queue of 200,000 messages to full: at D in 44.1 s

Before the snapshot was streamed and staged, a snapshot over 60 MiB was
refused by the ingress, and P held the whole encoded snapshot in memory.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lab.site import TwoSites, finish_client  # noqa: E402
from tests.lab import queues, status  # noqa: E402

MiB = 1024 * 1024
PUBLISHERS_PER_QUEUE = 2


def proc_kib(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of a process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def reset_peak(pid: int) -> None:
    """Make VmHWM start again from the current RSS (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def wait_until(what: str, check: Any, timeout: float) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting until {what}")
        time.sleep(0.5)
    return time.monotonic() - start


def load(two: TwoSites, queue: str, count: int, size: int) -> None:
    """``count`` messages of ``size`` bytes into ``queue`` at P, by parallel publishers."""
    share = -(-count // PUBLISHERS_PER_QUEUE)
    clients = []
    for i in range(PUBLISHERS_PER_QUEUE):
        n = min(share, count - i * share)
        if n > 0:
            argv = ["publish", two.p.amqp[1], queue, "--count", str(n)]
            argv += ["--start", str(1 + i * share), "--size", str(size)]
            clients.append(two.p.client_popen(1, *argv))
    for c in clients:
        got = finish_client(c, timeout=3600)
        if got["accepted"] <= 0:
            raise RuntimeError(f"publish to {queue}: {got}")


def d_complete(two: TwoSites, count: int) -> bool:
    p, d = queues(two.p.describe(1)), queues(two.d.describe(1))
    return (
        "q-full" in d
        and d["q-full"]["digest"] == p["q-full"]["digest"]
        and d.get("q-enq", {}).get("depth") == count
    )


class PeakWatch(threading.Thread):
    """Samples a process's RSS while a resync runs (VmHWM is the figure; the
    samples only show when the peak happened)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.25):
            try:
                self.samples.append(proc_kib(self.pid, "VmRSS"))
            except (OSError, RuntimeError):
                return


def resync(two: TwoSites, count: int, size: int) -> None:
    egress_pid = two.p.procs["sidecar-1"].pid
    time.sleep(2)  # the egress settles after the load (not a synchronisation)
    egress_before = proc_kib(egress_pid, "VmRSS")
    reset_peak(egress_pid)
    start = time.monotonic()
    two.start_d_sidecars()
    ingress_pid = two.d.procs["sidecar-1"].pid
    watch = PeakWatch(ingress_pid)
    watch.start()
    took = wait_until("D holds every message of P", lambda: d_complete(two, count), 3600)
    took = time.monotonic() - start
    watch.done.set()
    egress_peak = proc_kib(egress_pid, "VmHWM")
    time.sleep(3)  # the ingress settles (not a synchronisation)
    ingress_steady = proc_kib(ingress_pid, "VmRSS")
    ingress_peak = proc_kib(ingress_pid, "VmHWM")
    sent = status(two, "site-p", 1)["resync"]
    snapshot = sent["bytes_total"]
    print(
        f"resync of {2 * count:,} messages of {size} B "
        f"({snapshot / MiB:,.0f} MiB of snapshot) in {took:.1f} s: "
        f"{snapshot / MiB / took:.1f} MB/s, {2 * count / took:,.0f} messages/s"
    )
    print(
        f"  egress:  steady {egress_before / 1024:,.0f} MiB, peak {egress_peak / 1024:,.0f} MiB, "
        f"peak over steady {(egress_peak - egress_before) / 1024:+,.0f} MiB"
    )
    print(
        f"  ingress: steady {ingress_steady / 1024:,.0f} MiB, peak {ingress_peak / 1024:,.0f} MiB, "
        f"peak over steady {(ingress_peak - ingress_steady) / 1024:+,.0f} MiB "
        f"(highest sample {max(watch.samples, default=0) / 1024:,.0f} MiB)"
    )


def switch(two: TwoSites, count: int) -> None:
    load(two, "q-none", count, 100)
    if "q-none" in queues(two.d.describe(1)):
        raise RuntimeError("q-none is at D before the switch")
    start = time.monotonic()
    done = two.p.admin(1, "add-queue", "q-none", "--replicate", "full")
    if done.returncode != 0:
        raise RuntimeError(f"switch: {done.stderr}")

    def equal() -> bool:
        p, d = queues(two.p.describe(1)), queues(two.d.describe(1))
        return "q-none" in d and d["q-none"]["digest"] == p["q-none"]["digest"]

    wait_until("D's copy of the switched queue equals P's", equal, 3600)
    took = time.monotonic() - start
    print(f"rules switch of a queue of {count:,} messages to full: at D in {took:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=262_144, help="per queue")
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--switch", type=int, default=0, help="messages of a switched queue")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="resync-bench-") as workdir:
        two = TwoSites(
            nodes=args.nodes, workdir=workdir, metrics=True, spool_max_bytes=4 * 1024 * MiB
        )
        try:
            two.start_p_first()
            for queue, mode in (("q-full", "full"), ("q-enq", "enqueue"), ("q-none", "none")):
                done = two.p.admin(1, "add-queue", queue, "--replicate", mode)
                if done.returncode != 0:
                    raise RuntimeError(done.stderr)
            began = time.monotonic()
            load(two, "q-full", args.messages, args.size)
            load(two, "q-enq", args.messages, args.size)
            print(f"P loaded with 2 x {args.messages:,} in {time.monotonic() - began:.0f} s")
            resync(two, args.messages, args.size)
            if args.switch:
                switch(two, args.switch)
        finally:
            two.stop()


if __name__ == "__main__":
    main()
