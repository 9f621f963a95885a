"""What a site state snapshot of a big queue costs (cluster/state).

Prints, for one queue of N messages of 100 bytes (one in ten with
properties): the snapshot's size, and the seconds of ``snapshot`` (encode),
``restore`` and ``digest``.  Target on the 2-core development machine: encode
and restore each under 3 s for 100,000 messages; measured about 0.1 s, 0.3 s
and 0.1 s (docs/state.md, "Speed").  A figure, not a test: the fast suite
checks the round trip of a big queue, not its wall-clock time.

Run: ``.venv/bin/python bench/snapshot_bench.py [--messages N]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.state import apply, digest, messages, new_state, restore, snapshot
from protocol import cluster as pc

TARGET_S = 3.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    n = parser.parse_args().messages
    s = new_state()
    apply(s, pc.QueueDeclare("q"))
    body = b"x" * 100
    for i in range(n):
        apply(s, pc.Publish("", "q", body, f"id-{i}", {"n": i} if i % 10 == 0 else {}, ref=i))
    t0 = time.perf_counter()
    blob = snapshot(s)
    t1 = time.perf_counter()
    r = restore(blob)
    t2 = time.perf_counter()
    d = digest(r)
    t3 = time.perf_counter()
    assert d == digest(s) and len(messages(r, "q")) == n
    print(
        f"snapshot of {n:,} messages: {len(blob) / 1e6:.1f} MB, encode {t1 - t0:.3f} s, "
        f"restore {t2 - t1:.3f} s, digest {t3 - t2:.3f} s "
        f"(target: encode and restore under {TARGET_S:.0f} s each at 100,000)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
