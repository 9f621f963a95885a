"""Encode and decode rates of bus frames (protocol/cluster), next to bare ``struct``.

Prints events/s and MB/s for 200-byte messages, one per frame and in frames of
100, and in the same run the rate of a bare ``struct`` pack/unpack of the same
8-byte command header: the ceiling for Python.  The target: scanning a
batched frame's events (kind, queue name, size) at no less than 1/4 of the
bare unpack rate.

    .venv/bin/python bench/protocol_bench.py [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from protocol import cluster as c

BODY = b"x" * 200


def rate(fn: Callable[[], int], seconds: float) -> tuple[float, int]:
    """Events per second of ``fn`` (which returns how many events it did)."""
    events = 0
    calls = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        events += fn()
        calls += 1
        if calls % 16 == 0 and time.perf_counter() >= deadline:
            break
    return events / (time.perf_counter() - start), events


def _count(_frame: bytes, events: int) -> int:
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=1.0)
    seconds = parser.parse_args().seconds

    publish = c.Publish("", "orders.eu", BODY, "msg-000001", {}, 1)
    single = c.encode_frame([publish])
    batch_cmds = [publish] * 100
    batch = c.encode_frame(batch_cmds)
    per_event_bytes = len(batch) / 100

    header = c.INDEX_ENTRY
    packed = header.pack(7, 0, 9, 220)

    def bare_pack() -> int:
        out = [header.pack(7, 0, 9, 220) for _ in range(100)]
        return len(out)

    def bare_unpack() -> int:
        out = [header.unpack_from(packed) for _ in range(100)]
        return len(out)

    rows = [
        ("bare struct pack (8-byte header)", bare_pack, len(packed)),
        ("bare struct unpack (8-byte header)", bare_unpack, len(packed)),
        ("encode, 1 per frame", lambda: _count(c.encode_frame([publish]), 1), len(single)),
        ("encode, batch of 100", lambda: _count(c.encode_frame(batch_cmds), 100), per_event_bytes),
        ("scan, 1 per frame", lambda: len(c.scan_frame_untrusted(single)), len(single)),
        ("scan, batch of 100", lambda: len(c.scan_frame_untrusted(batch)), per_event_bytes),
        ("full decode, 1 per frame", lambda: len(c.decode_frame_untrusted(single)), len(single)),
        (
            "full decode, batch of 100",
            lambda: len(c.decode_frame_untrusted(batch)),
            per_event_bytes,
        ),
    ]
    results = {}
    print(f"{'operation':<38} {'events/s':>12} {'MB/s':>9}")
    for name, fn, size in rows:
        r, _ = rate(fn, seconds)
        results[name] = r
        print(f"{name:<38} {r:>12,.0f} {r * size / 1e6:>9.1f}")
    ratio = results["scan, batch of 100"] / results["bare struct unpack (8-byte header)"]
    print(f"\nscan of a batched frame / bare struct unpack = {ratio:.2f} (target >= 0.25)")


if __name__ == "__main__":
    main()
