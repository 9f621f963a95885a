"""Per-second rates of a few counters for ``/status`` (``drgate status`` shows
them), from statistics snapshots sampled about once a second by the HTTP
server; :mod:`gateway.metrics` re-exports these names."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

from cluster.statistics import NodeStatistics
from gateway.statistics import SidecarStatistics

# Rates over at most this many seconds of samples: long enough to smooth the
# batching of the link (linger, ack delay), short enough that an operator
# watching `drgate status --watch` sees a stall within seconds.
RATE_WINDOW_S = 10.0

Count = int | Mapping[Any, int] | None

# (status key, counter) of the counters that /status reports as rates; a
# mapping counter is summed.
RATE_COUNTERS: tuple[tuple[str, Callable[[SidecarStatistics], Count]], ...] = (
    ("commands_tapped_per_second", lambda s: s.tap.commands_total if s.tap else None),
    ("events_forwarded_per_second", lambda s: s.tap.forwarded_total if s.tap else None),
    ("events_sent_per_second", lambda s: s.link.events_sent_total),
    ("events_received_per_second", lambda s: s.link.events_received_total),
    ("bytes_sent_wire_per_second", lambda s: s.link.bytes_sent_wire_total),
    ("bytes_received_wire_per_second", lambda s: s.link.bytes_received_wire_total),
)


def rate_counters(stats: NodeStatistics) -> dict[str, float]:
    """The counters /status turns into rates (a mapping counter is summed); none for a broker."""
    if not isinstance(stats, SidecarStatistics):
        return {}
    out = {}
    for key, counter in RATE_COUNTERS:
        value = counter(stats)
        if isinstance(value, Mapping):
            out[key] = float(sum(value.values()))
        elif value is not None:
            out[key] = float(value)
    return out


class RateTracker:
    """Per-second rates of a few counters, from snapshots sampled with their time.

    ``observe(now, stats)`` records a sample; ``rates()`` gives, per
    counter, the increase over the samples of the last ``window`` seconds
    divided by the time between them, or ``None`` with fewer than two samples.
    A counter that goes down (a restarted process) restarts the window.
    """

    def __init__(self, *, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._samples: collections.deque[tuple[float, dict[str, float]]] = collections.deque()

    def observe(self, now: float, stats: NodeStatistics) -> None:
        counters = rate_counters(stats)
        if self._samples:
            last = self._samples[-1][1]
            if any(counters.get(k, v) < v for k, v in last.items()):
                self._samples.clear()
        self._samples.append((now, counters))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()

    def rates(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {key: None for key, _ in RATE_COUNTERS}
        if len(self._samples) < 2:
            return out
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        if t1 <= t0:
            return out
        for key, value in last.items():
            if key in first:
                out[key] = (value - first[key]) / (t1 - t0)
        return out

    @property
    def span(self) -> float:
        """Seconds between the oldest and newest sample (0 with fewer than two)."""
        if len(self._samples) < 2:
            return 0.0
        return self._samples[-1][0] - self._samples[0][0]
