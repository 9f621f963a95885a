"""Prometheus metrics and the ``/status`` document, built from plain snapshots.

Theory of operation: the sidecar and the broker keep their counters as plain
Python data and each hands out a ``statistics() -> dict`` snapshot (schema
below).  Nothing on the hot path touches prometheus-client: a scrape calls
the snapshot function once and :class:`SnapshotCollector` turns the dict into
metric families right then.  The same snapshot feeds :func:`status_document`
(the ``/status`` JSON), and :class:`RateTracker` derives per-second rates from
snapshots sampled about once a second by the HTTP server.

This is the only module that imports prometheus-client (tests/test_layering.py).

Snapshot schema (every key optional; a missing key means an absent metric)::

    {
      "site": "site-p", "node": 1, "process": "sidecar" | "broker", "cseq": n,
      "role": "egress" | "standby" | "ingress" | "ingress-standby" | "minority" | "starting",
      "bus": {"view_size": 3, "quorate": True, "members": 6},
      "tap": {"commands_total": {"PUBLISH": 10},                # by command kind
              "forwarded_total": {"full": 5, "enqueue": 3},     # by mode
              "filtered_total": {("none", "rule-name"): 4},     # (mode, rule) -> n
              "dropped_total": {"size": 1, "header": 2}},       # by reason
      "link": {"state": "up", "peer": "host:port",
               "bytes_sent_total": n, "bytes_sent_wire_total": n, "batches_sent_total": n,
               "bytes_received_total": n, "bytes_received_wire_total": n,
               "batches_received_total": n, "rtt_seconds": 0.05, "lag_events": 12,
               "lag_seconds": 0.3, "acked_seq": n, "last_seq": n, "reconnects_total": n,
               "events_sent_total": n, "events_received_total": n},
      "spool": {"bytes": n, "max_bytes": n, "segments": n, "overflow_total": n,
                "needs_resync": False, "first_seq": n, "last_seq": n},
      "merge": {"r1_duplicates": n, "r3_refused": n, "r4_dequeues_ignored": n,
                "r5_conflicts": n, "r6_conflicts": n, "r7_fenced": n,
                "incarnation_refused": n, "replicated_applied": n,
                ...any other cluster.state counter: n},
      "resync": {"active": False, "total": n, "progress_ratio": 0.0, "bytes_total": n},
      "rules": {"version": n, "failed_reloads_total": n, "digest": "...",
                "file_problem": "text" or ""},
      "state_transfer": {"count_total": n, "seconds_total": f},
      "last_error": "text" or "",
    }

Every metric carries the constant labels ``site``, ``node`` and ``process``
(those present in the snapshot).  Other labels have bounded cardinality: a
command kind, a mode, a rule name of the rules file, a drop reason, a role, a
link state, a merge rule.  Queue names and message ids are never labels.
The full list is in docs/observability.md.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

Snapshot = Mapping[str, Any]
SnapshotFunction = Callable[[], Snapshot]

# Every role a sidecar or broker can report (docs/architecture.md, section 8).  All of
# them are exported on every scrape (1 for the current one, 0 for the others),
# so `sum by (site) (drgate_role{role="egress"})` is 0, not absent, when no
# node is the egress.
ROLES = ("egress", "standby", "ingress", "ingress-standby", "minority", "starting")
LINK_STATES = ("up", "down", "connecting", "refused")
CONSTANT_LABELS = ("site", "node", "process")

# Rates over at most this many seconds of samples: long enough to smooth the
# batching of the link (linger, ack delay), short enough that an operator
# watching `drgate status --watch` sees a stall within seconds.
RATE_WINDOW_S = 10.0

# (status key, snapshot path) of the counters that /status reports as rates.
RATE_COUNTERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("commands_tapped_per_second", ("tap", "commands_total")),
    ("events_forwarded_per_second", ("tap", "forwarded_total")),
    ("events_sent_per_second", ("link", "events_sent_total")),
    ("events_received_per_second", ("link", "events_received_total")),
    ("bytes_sent_wire_per_second", ("link", "bytes_sent_wire_total")),
    ("bytes_received_wire_per_second", ("link", "bytes_received_wire_total")),
)


# Merge counters exported under their own names; every other key of "merge"
# becomes drgate_state_outcomes_total{outcome=key}.
_NAMED_MERGE_COUNTERS = frozenset(
    {
        "r1_duplicates",
        "r3_refused",
        "r4_dequeues_ignored",
        "r5_conflicts",
        "r6_conflicts",
        "r7_fenced",
        "incarnation_refused",
        "replicated_applied",
    }
)


def _number(value: Any) -> float | None:
    """The value as a float, or None when it is not a number (bools count as 0/1)."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        return float(value)
    return None


def _section(snapshot: Snapshot, key: str) -> Mapping[str, Any]:
    value = snapshot.get(key)
    return value if isinstance(value, Mapping) else {}


class _Families:
    """Metric families of one scrape, all with the same constant labels."""

    def __init__(self, constant: Mapping[str, str]) -> None:
        self._constant = dict(constant)
        self._families: dict[str, Metric] = {}

    def _family(self, kind: str, name: str, doc: str, label_names: Iterable[str]) -> Metric:
        family = self._families.get(name)
        if family is None:
            labels = [*self._constant, *label_names]
            if kind == "counter":
                family = CounterMetricFamily(name, doc, labels=labels)
            else:
                family = GaugeMetricFamily(name, doc, labels=labels)
            self._families[name] = family
        return family

    def add(
        self,
        kind: str,
        name: str,
        doc: str,
        value: Any,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        number = _number(value)
        if number is None:
            if value is not None:
                log.debug("metric %s: snapshot value %r is not a number, skipped", name, value)
            return
        labels = labels or {}
        family = self._family(kind, name, doc, labels)
        family.add_metric([*self._constant.values(), *labels.values()], number)  # type: ignore[attr-defined]

    def counter(self, name: str, doc: str, value: Any, **labels: str) -> None:
        self.add("counter", name, doc, value, labels)

    def gauge(self, name: str, doc: str, value: Any, **labels: str) -> None:
        self.add("gauge", name, doc, value, labels)

    def info(self, name: str, doc: str, value: Mapping[str, str]) -> None:
        family = InfoMetricFamily(name, doc, labels=list(self._constant))
        family.add_metric(list(self._constant.values()), dict(value))
        self._families[name] = family

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


def _constant_labels(snapshot: Snapshot) -> dict[str, str]:
    return {key: str(snapshot[key]) for key in CONSTANT_LABELS if snapshot.get(key) is not None}


def _one_of(
    out: _Families, name: str, doc: str, label: str, current: Any, known: tuple[str, ...]
) -> None:
    """A 0/1 gauge per known value, 1 for the current one (an unknown current one is added)."""
    if not isinstance(current, str):
        return
    values = known if current in known else (*known, current)
    for value in values:
        out.gauge(name, doc, value == current, **{label: value})


def _by_label(out: _Families, name: str, doc: str, label: str, counts: Any) -> None:
    if not isinstance(counts, Mapping):
        return
    for key, value in counts.items():
        out.counter(name, doc, value, **{label: str(key)})


def families_from_snapshot(snapshot: Snapshot) -> list[Metric]:
    """The metric families for one snapshot (see the module docstring for the schema)."""
    out = _Families(_constant_labels(snapshot))

    _one_of(
        out, "drgate_role", "1 for this node's current role", "role", snapshot.get("role"), ROLES
    )

    out.gauge(
        "drgate_bus_cseq",
        "Commands applied from the site bus (the state's cseq)",
        snapshot.get("cseq"),
    )
    bus = _section(snapshot, "bus")
    out.gauge("drgate_bus_view_size", "Members in the current site bus view", bus.get("view_size"))
    out.gauge("drgate_bus_quorate", "1 when the bus view is quorate", bus.get("quorate"))
    out.gauge("drgate_bus_members", "Bus members (brokers and sidecars)", bus.get("members"))

    tap = _section(snapshot, "tap")
    _by_label(
        out,
        "drgate_tap_commands_total",
        "Bus commands seen by the tap, by command kind",
        "kind",
        tap.get("commands_total"),
    )
    _by_label(
        out,
        "drgate_events_forwarded_total",
        "Replication events produced by the tap, by replication mode",
        "mode",
        tap.get("forwarded_total"),
    )
    filtered = tap.get("filtered_total")
    if isinstance(filtered, Mapping):
        for key, value in filtered.items():
            if isinstance(key, tuple | list) and len(key) == 2:
                mode, rule = str(key[0]), str(key[1])
            else:
                mode, rule = str(key), ""
            out.counter(
                "drgate_events_filtered_total",
                "Commands not forwarded because of the rules, by mode and deciding rule",
                value,
                mode=mode,
                rule=rule,
            )
    _by_label(
        out,
        "drgate_events_dropped_total",
        "Events dropped by the sidecar, by reason",
        "reason",
        tap.get("dropped_total"),
    )

    link = _section(snapshot, "link")
    state = link.get("state")
    if isinstance(state, str):
        out.gauge("drgate_link_up", "1 when the WAN link is up", state == "up")
    _one_of(
        out, "drgate_link_state", "1 for the WAN link's current state", "state", state, LINK_STATES
    )
    if isinstance(link.get("peer"), str) and link["peer"]:
        out.info("drgate_link_peer", "The WAN link's peer address", {"peer": link["peer"]})
    for direction in ("sent", "received"):
        out.counter(
            f"drgate_link_bytes_{direction}_total",
            f"Event bytes {direction} on the WAN link: raw (before compression) or wire",
            link.get(f"bytes_{direction}_total"),
            encoding="raw",
        )
        out.counter(
            f"drgate_link_bytes_{direction}_total",
            f"Event bytes {direction} on the WAN link: raw (before compression) or wire",
            link.get(f"bytes_{direction}_wire_total"),
            encoding="wire",
        )
        out.counter(
            f"drgate_link_batches_{direction}_total",
            f"Batches {direction} on the WAN link",
            link.get(f"batches_{direction}_total"),
        )
        out.counter(
            f"drgate_link_events_{direction}_total",
            f"Events {direction} on the WAN link",
            link.get(f"events_{direction}_total"),
        )
    out.counter(
        "drgate_link_reconnects_total",
        "WAN link connections after the first",
        link.get("reconnects_total"),
    )
    out.gauge(
        "drgate_link_rtt_seconds", "Last measured WAN round-trip time", link.get("rtt_seconds")
    )
    out.gauge(
        "drgate_lag_events", "Events sent or spooled and not yet acked by D", link.get("lag_events")
    )
    out.gauge(
        "drgate_lag_seconds",
        "Age of the oldest unacked event (P's commit time to now); 0 when none",
        link.get("lag_seconds"),
    )
    out.gauge("drgate_link_acked_seq", "Highest sequence number acked by D", link.get("acked_seq"))
    out.gauge(
        "drgate_link_last_seq", "Highest sequence number sent or received", link.get("last_seq")
    )

    spool = _section(snapshot, "spool")
    out.gauge("drgate_spool_bytes", "Bytes in the spool", spool.get("bytes"))
    out.gauge("drgate_spool_max_bytes", "The spool's size limit", spool.get("max_bytes"))
    out.gauge("drgate_spool_segments", "Segment files in the spool", spool.get("segments"))
    out.counter(
        "drgate_spool_overflow_total",
        "Times a full spool dropped its oldest segments",
        spool.get("overflow_total"),
    )
    out.gauge(
        "drgate_spool_first_seq", "Lowest sequence number in the spool", spool.get("first_seq")
    )
    out.gauge(
        "drgate_spool_last_seq", "Highest sequence number in the spool", spool.get("last_seq")
    )
    out.gauge(
        "drgate_resync_needed",
        "1 when D is behind the spool's floor and needs a resync",
        spool.get("needs_resync"),
    )

    merge = _section(snapshot, "merge")
    out.counter(
        "drgate_duplicates_dropped_total",
        "Replicated commands at or below applied[origin], dropped (R1)",
        merge.get("r1_duplicates"),
    )
    out.counter(
        "drgate_merge_refused_total",
        "Local writes refused on read-only full replicas (R3)",
        merge.get("r3_refused"),
        rule="R3",
    )
    out.counter(
        "drgate_merge_ignored_total",
        "Remote dequeues not applied to enqueue-mode queues (R4)",
        merge.get("r4_dequeues_ignored"),
        rule="R4",
    )
    for rule in ("R5", "R6"):
        out.counter(
            "drgate_merge_conflicts_total",
            "Merge conflicts at D, by rule (R5 dequeue of a missing message, R6 declare clash)",
            merge.get(f"{rule.lower()}_conflicts"),
            rule=rule,
        )
    out.counter(
        "drgate_fenced_total", "Commands refused for a stale epoch (R7)", merge.get("r7_fenced")
    )
    out.counter(
        "drgate_incarnation_refused_total",
        "Replicated commands refused for an unaccepted origin incarnation",
        merge.get("incarnation_refused"),
    )
    out.counter(
        "drgate_replicated_applied_total",
        "Replicated commands applied at D",
        merge.get("replicated_applied"),
    )

    for key, count in merge.items():
        # The state machine's other counters (cluster.state COUNTERS, a fixed set).
        if key not in _NAMED_MERGE_COUNTERS:
            out.counter(
                "drgate_state_outcomes_total",
                "Other outcomes counted by the site state machine, by counter name",
                count,
                outcome=str(key),
            )

    resync = _section(snapshot, "resync")
    out.gauge("drgate_resync_active", "1 while a resync is running", resync.get("active"))
    out.counter("drgate_resyncs_total", "Resyncs started", resync.get("total"))
    out.gauge(
        "drgate_resync_progress_ratio",
        "Progress of the running resync, 0 to 1",
        resync.get("progress_ratio"),
    )
    out.counter(
        "drgate_resync_bytes_total",
        "Resync snapshot bytes sent or received",
        resync.get("bytes_total"),
    )

    rules = _section(snapshot, "rules")
    out.gauge("drgate_rules_version", "Version of the rules in force", rules.get("version"))
    out.counter(
        "drgate_rules_reload_failures_total",
        "Rules file changes refused (invalid file)",
        rules.get("failed_reloads_total"),
    )
    if "file_problem" in rules:
        out.gauge(
            "drgate_rules_file_invalid",
            "1 while the rules file on disk is invalid and the rules in force stay",
            bool(rules["file_problem"]),
        )
    if isinstance(rules.get("digest"), str) and rules["digest"]:
        out.info("drgate_rules", "Digest of the rules in force", {"digest": rules["digest"]})

    transfer = _section(snapshot, "state_transfer")
    out.counter(
        "drgate_state_transfers_total",
        "State transfers received at start-up",
        transfer.get("count_total"),
    )
    out.counter(
        "drgate_state_transfer_seconds_total",
        "Time spent in state transfers",
        transfer.get("seconds_total"),
    )

    last_error = snapshot.get("last_error")
    if isinstance(last_error, str):
        # The text itself is unbounded: it is in /status, the metric only says "there is one".
        out.gauge("drgate_last_error_present", "1 when the node reports an error", bool(last_error))
    return list(out)


class SnapshotCollector(Collector):
    """A prometheus-client collector that reads a ``statistics()`` snapshot at scrape time.

    ``snapshot`` is called once per scrape, in the scraping thread or task
    (the trio HTTP server calls it on the trio thread, so it may read trio-owned
    state).  An exception from it propagates to the scrape, which fails with
    HTTP 500: a broken snapshot is visible, not an empty page.
    """

    def __init__(self, snapshot: SnapshotFunction) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        # Not calling the snapshot at registration: the sidecar may not be ready yet.
        return []

    def collect(self) -> Iterator[Metric]:
        yield from families_from_snapshot(self._snapshot())


def build_registry(snapshot: SnapshotFunction, *, process: bool = True) -> CollectorRegistry:
    """A registry holding a :class:`SnapshotCollector` (and the process collector)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    if process:
        ProcessCollector(registry=registry)
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text exposition format."""
    return generate_latest(registry)


def _sum(value: Any) -> float | None:
    if isinstance(value, Mapping):
        numbers = [_number(v) for v in value.values()]
        return sum(n for n in numbers if n is not None)
    return _number(value)


def rate_counters(snapshot: Snapshot) -> dict[str, float]:
    """The counters /status turns into rates (a mapping counter is summed)."""
    out = {}
    for key, (section, field) in RATE_COUNTERS:
        value = _sum(_section(snapshot, section).get(field))
        if value is not None:
            out[key] = value
    return out


class RateTracker:
    """Per-second rates of a few counters, from snapshots sampled with their time.

    ``observe(now, snapshot)`` records a sample; ``rates()`` gives, per
    counter, the increase over the samples of the last ``window`` seconds
    divided by the time between them, or ``None`` with fewer than two samples.
    A counter that goes down (a restarted process) restarts the window.
    """

    def __init__(self, *, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._samples: collections.deque[tuple[float, dict[str, float]]] = collections.deque()

    def observe(self, now: float, snapshot: Snapshot) -> None:
        counters = rate_counters(snapshot)
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


def _plain(value: Any) -> Any:
    """JSON-safe copy: tuple keys become "a/b", non-finite floats become None."""
    if isinstance(value, Mapping):
        return {
            "/".join(map(str, k)) if isinstance(k, tuple | list) else str(k): _plain(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def status_document(
    snapshot: Snapshot, rates: Mapping[str, float | None] | None = None
) -> dict[str, Any]:
    """The ``/status`` JSON for one snapshot (fields listed in docs/observability.md)."""
    link = _section(snapshot, "link")
    spool = _section(snapshot, "spool")
    rules = _section(snapshot, "rules")
    used = None
    size, limit = _number(spool.get("bytes")), _number(spool.get("max_bytes"))
    if size is not None and limit:
        used = size / limit
    doc: dict[str, Any] = {
        "site": snapshot.get("site"),
        "node": snapshot.get("node"),
        "process": snapshot.get("process"),
        "role": snapshot.get("role"),
        "peer": link.get("peer"),
        "link_state": link.get("state"),
        "lag_events": link.get("lag_events"),
        "lag_seconds": link.get("lag_seconds"),
        "rtt_seconds": link.get("rtt_seconds"),
        "acked_seq": link.get("acked_seq"),
        "last_seq": link.get("last_seq"),
        "rates": dict(rates) if rates is not None else {key: None for key, _ in RATE_COUNTERS},
        "spool": {
            "bytes": spool.get("bytes"),
            "max_bytes": spool.get("max_bytes"),
            "used_ratio": used,
            "segments": spool.get("segments"),
            "overflow_total": spool.get("overflow_total"),
            "needs_resync": spool.get("needs_resync"),
        },
        "rules_version": rules.get("version"),
        "rules_digest": rules.get("digest"),
        "rules_file_problem": rules.get("file_problem") or "",
        "rules_reload_failures": rules.get("failed_reloads_total"),
        "bus": dict(_section(snapshot, "bus")),
        "resync": dict(_section(snapshot, "resync")),
        "merge": dict(_section(snapshot, "merge")),
        "last_error": snapshot.get("last_error") or "",
    }
    return _plain(doc)  # type: ignore[no-any-return]
