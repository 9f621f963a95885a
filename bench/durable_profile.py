"""Where a durable broker's time goes: one durable site (3 nodes, embedded
bus, journals with ``fsync: batch``), ``--clients`` publishers on node 1, CPU
per process (/proc) and a py-spy profile of each broker.

    .venv/bin/python bench/durable_profile.py --clients 1 --dir /var/tmp

py-spy on the PATH or ``PY_SPY=/path/to/py-spy`` (none: CPU only).  The
profiles' raw collapsed stacks stay in ``--out`` (default /tmp/durable-profile).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.broker_bench import CREDIT, QUEUE, SIZE, declare, publish_clients  # noqa: E402
from bench.proccpu import CpuMeter, Profiler, profile_table  # noqa: E402
from lab.site import BrokerSite  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/durable-profile"))
    parser.add_argument("--memory", action="store_true", help="no journals (the reference)")
    parser.add_argument("--no-spy", action="store_true", help="CPU only")
    parser.add_argument(
        "--fsyncs", action="store_true", help="count each broker's fdatasync calls (strace)"
    )
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(dir=args.dir, prefix="durable-profile-") as tmp,
        BrokerSite("bench", nodes=3, workdir=Path(tmp), durable=not args.memory) as site,
    ):
        declare(site)
        publish_clients(site, args.clients, 200, "w", durable=True)  # warm up
        pids = {name: proc.pid for name, proc in site.procs.items()}
        meter = CpuMeter(pids)
        spy = (
            None
            if args.no_spy
            else Profiler({n: p for n, p in pids.items() if n.startswith("broker")}, args.out)
        )
        tracers = {}
        if args.fsyncs:
            for name, pid in pids.items():
                if name.startswith("broker"):
                    out = args.out / f"{name}.strace"
                    args.out.mkdir(parents=True, exist_ok=True)
                    argv = ["strace", "-f", "-c", "-e", "trace=fdatasync", "-o", str(out)]
                    tracers[name] = (subprocess.Popen([*argv, "-p", str(pid)]), out)
            time.sleep(1)  # strace attaches to every thread
        meter.start()
        if spy is not None:
            spy.start()
        seconds = publish_clients(site, args.clients, args.count, "m", durable=True)
        files = {} if spy is None else spy.stop()
        cpu = meter.stop()
        for name, (proc, out) in tracers.items():
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
            calls = [ln.split() for ln in out.read_text().splitlines() if "fdatasync" in ln]
            print(f"  {name}: {calls[0][3] if calls else 0} fdatasync calls")
        total = args.clients * args.count
        print(
            f"{args.clients} x {args.count} durable publishes of {SIZE} B, window {CREDIT}, "
            f"queue {QUEUE}: {seconds:.2f} s, {total / seconds:,.0f}/s "
            f"(client start included)"
        )
        for name, sec in sorted(cpu.items()):
            print(f"  {name:<10} {sec:6.2f} s CPU, {sec / total * 1e6:6.1f} µs per publish")
        for name, path in sorted(files.items()):
            print(profile_table(name, path, top=25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
