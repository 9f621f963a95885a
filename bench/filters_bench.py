"""Decisions per second of the compiled rules matcher.

A generated 100-rule file (queue rules, some message rules with header
tests, a from-args default).  Three figures from the same run:

* ceiling: a plain dict lookup of the queue name (``d[q]``), the rate a
  cached decision cannot beat;
* queue-only, cached: ``ruleset.decisions[queue]``, the tap's hot path for
  queue-level events once the queue has been decided;
* queue-only, call: ``ruleset.decide_queue(queue, args)`` on a cached queue
  (a Python call, an identity test of the args);
* header rules: ``ruleset.decide_message(...)`` on queues whose message
  rules test headers (the header tests run on every call).

Target: queue-only at no less than half the dict-lookup rate.

Run: ``.venv/bin/python bench/filters_bench.py [--seconds S]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from filters.rules import load_rules

N_RULES = 100
N_QUEUES = 1000


def rules_text() -> str:
    lines = ["version: 1", "rules:"]
    for i in range(N_RULES):
        if i % 10 == 0:
            lines += [
                f"  - name: hdr{i}",
                "    match:",
                f'      queue: "svc{i}.*"',
                "      headers:",
                "        - {header: region, in: [eu, uk]}",
                "        - {header: tier, equals: gold}",
                "    action: {mode: full}",
            ]
        else:
            lines += [
                f"  - name: q{i}",
                f'    match: {{queue: "svc{i}.*"}}',
                f"    action: {{mode: {('full', 'enqueue', 'wiring')[i % 3]}}}",
            ]
    lines += ["default: {mode: from-args, fallback: none}", ""]
    return "\n".join(lines)


def rates(fns: dict[str, Callable[[int], None]], seconds: float) -> dict[str, float]:
    """Operations per second of each ``fn(n)`` (which performs n operations).

    Best of 5 rounds, the figures measured in turn within each round, so
    that a busy moment on a shared machine hurts them all alike.
    """
    sizes = {}
    for name, fn in fns.items():
        n = 10_000
        while True:  # size the batch to ~1/10 of the budget
            t0 = time.perf_counter()
            fn(n)
            if time.perf_counter() - t0 > seconds / 10:
                break
            n *= 2
        sizes[name] = n
    best = dict.fromkeys(fns, 0.0)
    for _ in range(5):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(sizes[name])
            best[name] = max(best[name], sizes[name] / (time.perf_counter() - t0))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="budget per figure")
    opts = parser.parse_args()

    ruleset = load_rules(rules_text(), "bench.yaml")
    assert len(ruleset.rules) == N_RULES and not ruleset.warnings
    queues = [f"svc{(i * 7) % N_RULES}.q{i}" for i in range(N_QUEUES)]
    args = {q: {"x-queue-type": "classic"} for q in queues}  # the tap's shadow-state args
    header_queues = [f"svc{10 * (i % 10)}.h{i}" for i in range(N_QUEUES)]
    hargs: dict[str, None] = dict.fromkeys(header_queues)
    headers = [{"region": "eu", "tier": "gold"}, {"region": "us", "tier": "gold"}]
    table = {q: i for i, q in enumerate(queues)}

    work = [(q, args[q]) for q in queues]
    for q, a in work:  # warm the cache
        ruleset.decide_queue(q, a)

    def dict_lookup(n: int) -> None:
        d = table
        reps, rest = divmod(n, N_QUEUES)
        for _ in range(reps):
            for q, _a in work:
                d[q]
        for q, _a in work[:rest]:
            d[q]

    def queue_only_cached(n: int) -> None:
        d = ruleset.decisions
        reps, rest = divmod(n, N_QUEUES)
        for _ in range(reps):
            for q, _a in work:
                d[q]
        for q, _a in work[:rest]:
            d[q]

    def queue_only_call(n: int) -> None:
        decide = ruleset.decide_queue
        reps, rest = divmod(n, N_QUEUES)
        for _ in range(reps):
            for q, a in work:
                decide(q, a)
        for q, a in work[:rest]:
            decide(q, a)

    msgs = [(q, hargs[q], headers[i % 2]) for i, q in enumerate(header_queues)]

    def header_rules(n: int) -> None:
        decide = ruleset.decide_message
        reps, rest = divmod(n, N_QUEUES)
        for _ in range(reps):
            for q, a, h in msgs:
                decide(q, a, "amq.topic", "k", h, 100)
        for q, a, h in msgs[:rest]:
            decide(q, a, "amq.topic", "k", h, 100)

    got = rates(
        {
            "ceiling": dict_lookup,
            "cached": queue_only_cached,
            "call": queue_only_call,
            "header": header_rules,
        },
        opts.seconds,
    )
    ceiling, cached, call, hdr = got["ceiling"], got["cached"], got["call"], got["header"]
    ratio = cached / ceiling
    print(f"rules: {N_RULES}, queues: {N_QUEUES}, misses: {ruleset.statistics()['cache_misses']}")
    print(f"dict lookup (ceiling):       {ceiling:>14,.0f} /s")
    print(f"queue-only, cached:          {cached:>14,.0f} decisions/s  (ruleset.decisions[q])")
    print(f"queue-only, decide_queue():  {call:>14,.0f} decisions/s  (cached, via the call)")
    print(f"header rules (message):      {hdr:>14,.0f} decisions/s")
    verdict = "meets" if ratio >= 0.5 else "MISSES"
    print(f"queue-only / ceiling:        {ratio:>14.2f}  ({verdict} the >= 0.50 target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
