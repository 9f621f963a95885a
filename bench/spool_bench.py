"""Append and read-back rates of the spool (gateway/spool.py).

Appends 200-byte events in batches of 100 with fsync ``never`` and ``batch``,
then reads them all back with ``read_after`` in 1 MiB pages, and prints
events/s and MB/s (payload bytes) for each.  The spool lives in a temporary
directory (``--dir`` to put it on the disk the sidecar would use).

    .venv/bin/python bench/spool_bench.py [--events 200000] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from gateway.spool import FsyncPolicy, Spool

PAYLOAD = 200
BATCH = 100


def bench(policy: FsyncPolicy, n_events: int, base: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix=f"spool-{policy.value}-", dir=base))
    payload = b"p" * PAYLOAD
    batches = [
        [(seq, seq * 10, payload) for seq in range(first, first + BATCH)]
        for first in range(1, n_events + 1, BATCH)
    ]
    try:
        with Spool.open(directory, max_bytes=4 << 30, segment_bytes=16 << 20, fsync=policy) as s:
            start = time.perf_counter()
            for batch in batches:
                s.append_many(batch)
            append_s = time.perf_counter() - start
            stats = s.statistics()

            start = time.perf_counter()
            after, read = 0, 0
            while True:
                page = s.read_after(after, 1 << 20)
                if not page:
                    break
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
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--dir", type=Path, default=None, help="where to make the spool")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.gettempdir())
    print(f"{args.events:,} events of {PAYLOAD} B in batches of {BATCH}, spool under {base}")
    for policy in (FsyncPolicy.NEVER, FsyncPolicy.BATCH):
        bench(policy, args.events, base)


if __name__ == "__main__":
    main()
