"""A replication event encoded and decoded by the generic codec and by hand
(protocol/eventframe.py), alternating in one process: µs per event of one
``Enqueue`` of 10 bytes with one property, the best and the median of the
rounds (docs/performance.md, "The event by hand").

    .venv/bin/python bench/event_bench.py [--rounds 5] [--count 50000]
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

from protocol import cluster as pc
from protocol.eventframe import encode_event
from protocol.modes import Mode

PROPS = {"sent_at": 1_700_000_000_000_000}
HEAD = ("site-p", 0x1122334455667788, 99_999, 1, 1_700_000_000_000_000, (Mode.ENQUEUE,))


def enqueue() -> pc.Enqueue:
    return pc.Enqueue("dr.q", 12_345, b"x" * 10, "c-1234", PROPS)


def encode_generic() -> bytes:
    return pc.encode_frame([pc.Replicated(*HEAD, (enqueue(),))])


def encode_by_hand() -> bytes:
    return encode_event(*HEAD, (enqueue(),))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=50_000)
    args = parser.parse_args()
    frame = encode_generic()
    fast = dict(pc.FAST_DECODERS)

    def decode_by_hand() -> object:
        pc.FAST_DECODERS.update(fast)
        return pc.decode_frame_untrusted(frame)

    def decode_generic() -> object:
        pc.FAST_DECODERS.clear()
        return pc.decode_frame_untrusted(frame)

    cases: dict[str, Callable[[], object]] = {
        "encode, generic": encode_generic,
        "encode, by hand": encode_by_hand,
        "decode, generic": decode_generic,
        "decode, by hand": decode_by_hand,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            fn()  # the decoders' registry as the case wants it, then timed
            times[name].append(timeit.timeit(fn, number=args.count) / args.count * 1e6)
    pc.FAST_DECODERS.update(fast)
    for name, values in times.items():
        values.sort()
        print(f"{name:<18} best {values[0]:6.2f} µs   median {values[len(values) // 2]:6.2f} µs")


if __name__ == "__main__":
    main()
