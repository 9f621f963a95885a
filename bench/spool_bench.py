"""What the spool (gateway/spool.py) costs, and what a thread hop would cost instead.

Prints, for 200-byte events, with fsync ``never`` and ``batch``:

* throughput: ``append_many`` in batches of 100, then ``read_after`` in 1 MiB
  pages (events/s and MB/s of payload);
* latency of one ``append_many`` call (its fdatasync included) for batches of
  1, 10, 100 and 1000 events: p50, p90, p99 and max in microseconds.  This is
  how long the trio thread is held when the applier's ``_after_frame`` hook
  spools one frame's events;
* ``trim`` inside the head segment (rewrites ``spool.state``) and ``trim``
  that deletes whole segments;
* ``read_after`` as the egress calls it: the events of the batch just
  appended (caught up), a 1 MiB replay page, and nothing new;
* ``Spool.open`` of an existing spool (it scans and checks every record);
* one ``trio.to_thread.run_sync`` round trip of a no-op, the floor of what
  moving any of these calls off the trio thread would add per call.

``--rss GIB`` instead fills a spool of GIB gibibytes with small events (100 B
payloads) and prints the process's resident memory: holding the spool open
(its index), answering ``Spool.lag`` (how the egress computes its lag), and,
for comparison, a ``(seq, time_us)`` pair per unacked event kept in a deque
(how the egress kept its lag before), in a fresh process.  Measured:

    spool of 1 GiB, 8.1 M events of 100 B   imports 31 MB; open + lag 65 MB; + pairs 1,096 MB
    spool of 0.25 GiB, 2 M events           imports 31 MB; open + lag 47 MB; + pairs   298 MB

Of the 34 MB the open adds, Python holds 2 MB (the sparse index: three ints
per 64 KiB); the rest is what the allocator keeps of the scan's 16 MiB
segment buffers.

The spool lives in a temporary directory (``--dir`` to put it on the disk the
sidecar would use: the fdatasync figures are the disk's, not the code's).

    .venv/bin/python bench/spool_bench.py [--events 200000] [--dir /var/tmp]

The stalls the spool's calls cost the trio thread (gateway/spool.py runs them
there), ext4 on a virtual disk, 200-byte events; p50 / p99 with the disk to
itself, then with other processes' tests loading it:

    append_many fsync=batch, 1 to 100 events  0.11-0.3 / 0.3-1.8 ms; loaded 0.7-1 / 9 ms
                             1000 events      1 / 2-3.5 ms;          loaded 1.9 / 11 ms
    append_many fsync=never, 100 events       70 / 105-280 µs
    trim (rewrites spool.state), batch        0.4-0.9 / 0.8-1.3 ms;  loaded 2-3 / 12-15 ms
    read_after, p50: 100 newest events        6 µs (memory; 61 read back); 1 MiB replay 2.6 ms
    open: the scan, per 45 MB spooled         120-150 ms
    trio.to_thread.run_sync(no-op)            43-66 µs / 0.1-1.2 ms

A hop costs a third to a half of a small batch's fdatasync and would free the
loop only for the rest.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import trio

from gateway.spool import FsyncPolicy, Spool

T = TypeVar("T")
PAYLOAD = 200
BATCH = 100
BATCH_SIZES = (1, 10, 100, 1000)
# Calls timed per latency row: enough for a p99, few enough for a slow disk.
CALLS = 400
SEGMENT_BYTES = 16 << 20


@contextmanager
def spool_in(
    base: Path, policy: FsyncPolicy, *, segment_bytes: int = SEGMENT_BYTES
) -> Iterator[Spool]:
    directory = Path(tempfile.mkdtemp(prefix=f"spool-{policy.value}-", dir=base))
    try:
        with Spool.open(
            directory, max_bytes=4 << 30, segment_bytes=segment_bytes, fsync=policy
        ) as spool:
            yield spool
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def events(first: int, n: int, payload_bytes: int = PAYLOAD) -> list[tuple[int, int, bytes, int]]:
    payload = b"p" * payload_bytes
    return [(seq, seq * 10, payload, seq - 1) for seq in range(first, first + n)]


def percentiles(samples_s: list[float]) -> str:
    us = sorted(s * 1e6 for s in samples_s)
    q = statistics.quantiles(us, n=100, method="inclusive")
    return f"p50 {q[49]:>8.0f}  p90 {q[89]:>8.0f}  p99 {q[98]:>8.0f}  max {us[-1]:>8.0f} µs"


def timed(call: Callable[[T], object], args: Iterable[T]) -> list[float]:
    """Seconds each ``call(arg)`` took."""
    samples = []
    for arg in args:
        start = time.perf_counter()
        call(arg)
        samples.append(time.perf_counter() - start)
    return samples


def throughput(policy: FsyncPolicy, n_events: int, base: Path) -> None:
    batches = [events(first, BATCH) for first in range(1, n_events + 1, BATCH)]
    with spool_in(base, policy) as s:
        start = time.perf_counter()
        for batch in batches:
            s.append_many(batch)
        append_s = time.perf_counter() - start
        stats = s.statistics()
        start = time.perf_counter()
        after, read = 0, 0
        while page := s.read_after(after, 1 << 20):
            read += len(page)
            after = page[-1][0]
        read_s = time.perf_counter() - start
    assert read == n_events, (read, n_events)
    mb = n_events * PAYLOAD / 1e6
    print(
        f"append fsync={policy.value:<6} {n_events / append_s:>10,.0f} events/s "
        f"{mb / append_s:>7.1f} MB/s  ({stats.segments} segments, {stats.fsyncs} fsyncs, "
        f"{append_s:.2f} s)"
    )
    print(
        f"read   fsync={policy.value:<6} {n_events / read_s:>10,.0f} events/s "
        f"{mb / read_s:>7.1f} MB/s  ({read_s:.2f} s)"
    )


def append_latency(policy: FsyncPolicy, base: Path) -> None:
    for size in BATCH_SIZES:
        calls = CALLS if size < 1000 else CALLS // 4
        with spool_in(base, policy) as s:
            batches = [events(1 + i * size, size) for i in range(calls)]
            samples = timed(s.append_many, batches)
        print(f"append_many fsync={policy.value:<6} {size:>5} events  {percentiles(samples)}")


def trim_costs(policy: FsyncPolicy, base: Path) -> None:
    with spool_in(base, policy) as s:  # one 16 MiB segment: no trim deletes a file
        s.append_many(events(1, 60_000))
        samples = timed(s.trim, range(1, CALLS + 1))
        print(f"trim in the head segment  fsync={policy.value:<6}   {percentiles(samples)}")
    with spool_in(base, policy, segment_bytes=64 << 10) as s:  # ~290 events a segment
        s.append_many(events(1, 60_000))
        per_segment = 60_000 // s.statistics().segments
        samples = timed(s.trim, range(per_segment, 101 * per_segment, per_segment))
        print(f"trim deleting 1 segment   fsync={policy.value:<6}   {percentiles(samples)}")


def read_costs(base: Path) -> None:
    with spool_in(base, FsyncPolicy.NEVER) as s:
        s.append_many(events(1, 100_000))
        samples = []
        for i in range(CALLS):  # the egress caught up: the frame just spooled
            first = 100_001 + i * 100
            s.append_many(events(first, 100))
            start = time.perf_counter()
            assert len(s.read_after(first - 1, 1 << 20)) == 100
            samples.append(time.perf_counter() - start)
        print(f"read_after: the 100 newest events        {percentiles(samples)}")
        samples = timed(lambda after: s.read_after(after, 1 << 20), range(1, 100_000, 1000))
        print(f"read_after: a 1 MiB replay page          {percentiles(samples)}")
        last = s.statistics().last_seq or 0
        samples = timed(lambda after: s.read_after(after, 1 << 20), [last] * CALLS)
        print(f"read_after: nothing new                  {percentiles(samples)}")


def open_cost(n_events: int, base: Path) -> None:
    with spool_in(base, FsyncPolicy.NEVER) as s:
        s.append_many(events(1, n_events))
        mb = s.statistics().bytes / 1e6
        s.close()
        start = time.perf_counter()
        Spool.open(s.directory, max_bytes=4 << 30, segment_bytes=SEGMENT_BYTES).close()
        took = time.perf_counter() - start
    print(f"Spool.open (recovery scan) of {mb:.0f} MB   {took * 1e3:>8.0f} ms")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss(gib: float, base: Path) -> None:
    """Resident memory of a process that opens a spool of ``gib`` GiB of small events."""
    target, batch, first = int(gib * (1 << 30)), 10_000, 1
    with spool_in(base, FsyncPolicy.NEVER) as s:
        while s.statistics().bytes < target:
            s.append_many(events(first, batch, payload_bytes=100))
            first += batch
        s.close()
        # A fresh process, so that what filling the spool allocated does not count.
        subprocess.run([sys.executable, __file__, "--rss-of", str(s.directory)], check=True)


def rss_of(directory: Path) -> None:
    print(f"imports only: RSS {rss_mb():,.0f} MB")
    with Spool.open(directory, max_bytes=4 << 30, segment_bytes=SEGMENT_BYTES) as s:
        n, oldest = s.lag(0)
        st = s.statistics()
        print(
            f"spool of {st.bytes / (1 << 30):.2f} GiB, {st.records:,} events open, lag "
            f"{n:,} events since {oldest}: RSS {rss_mb():,.0f} MB"
        )
        unacked = deque((seq, seq * 10) for seq in range(1, n + 1))
        print(f"plus a (seq, time_us) per unacked event, as before: RSS {rss_mb():,.0f} MB")
        del unacked


def thread_hop() -> None:
    async def hops() -> list[float]:
        samples = []
        for _ in range(CALLS):
            start = time.perf_counter()
            await trio.to_thread.run_sync(lambda: None)
            samples.append(time.perf_counter() - start)
        return samples

    print(f"trio.to_thread.run_sync(no-op)           {percentiles(trio.run(hops))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--dir", type=Path, default=None, help="where to make the spool")
    parser.add_argument("--rss", type=float, metavar="GIB", help="only the memory of a full spool")
    parser.add_argument("--rss-of", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    base = args.dir or Path(tempfile.gettempdir())
    if args.rss_of:
        rss_of(args.rss_of)
        return
    if args.rss:
        rss(args.rss, base)
        return
    print(f"{args.events:,} events of {PAYLOAD} B in batches of {BATCH}, spool under {base}")
    for policy in (FsyncPolicy.NEVER, FsyncPolicy.BATCH):
        throughput(policy, args.events, base)
    for policy in (FsyncPolicy.NEVER, FsyncPolicy.BATCH):
        append_latency(policy, base)
    for policy in (FsyncPolicy.NEVER, FsyncPolicy.BATCH):
        trim_costs(policy, base)
    read_costs(base)
    open_cost(args.events, base)
    thread_hop()


if __name__ == "__main__":
    main()
