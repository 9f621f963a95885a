"""Prometheus metrics and the ``/status`` document, built from typed snapshots.

Theory of operation: the sidecar and the broker keep plain counters and hand
out a frozen ``statistics()`` snapshot (:class:`cluster.statistics.NodeStatistics`,
or :class:`gateway.statistics.SidecarStatistics` with the sidecar's sections).
Nothing on the hot path touches prometheus-client:
a scrape calls the snapshot function once and :class:`SnapshotCollector`
turns the snapshot into metric families right then.  The same snapshot feeds
:func:`gateway.statusdoc.status_document` (the ``/status`` JSON), and :class:`RateTracker`
derives per-second rates from snapshots sampled about once a second by the
HTTP server.  A section or field that is ``None`` is an absent metric.

This is the only module that imports prometheus-client (tests/test_layering.py).

Every metric carries the constant labels ``site``, ``node`` and ``process``.
Other labels have bounded cardinality: a command kind, a mode, a rule name of
the rules file, a drop reason, a role, a link state, a merge rule, a counter
name of the state machine.  Queue names and message ids are never labels.
The full list is in docs/observability.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cluster.statistics import DonationSection, JournalSection, NodeStatistics
from gateway.rates import RATE_COUNTERS, RATE_WINDOW_S, RateTracker, rate_counters
from gateway.roles import SidecarRole
from gateway.statistics import (
    DrSection,
    LinkSection,
    ResyncSection,
    RulesSection,
    SidecarStatistics,
    SpoolSection,
)

__all__ = [
    "RATE_COUNTERS",
    "RATE_WINDOW_S",
    "RateTracker",
    "SnapshotCollector",
    "build_registry",
    "families_from_snapshot",
    "rate_counters",
    "render_metrics",
]

log = logging.getLogger(__name__)

SnapshotFunction = Callable[[], NodeStatistics]

# Every role a sidecar can report (docs/architecture.md, section 8).  All of
# them are exported on every scrape (1 for the current one, 0 for the others),
# so `sum by (site) (drgate_role{role="egress"})` is 0, not absent, when no
# node is the egress.
ROLES = tuple(str(role) for role in SidecarRole)
LINK_STATES = ("up", "down", "connecting", "refused")

Number = float | int | bool | None

S = TypeVar("S")


@dataclasses.dataclass(frozen=True, slots=True)
class _Row(Generic[S]):
    """One metric read from one field of a section."""

    kind: str  # "counter" or "gauge"
    name: str
    doc: str
    value: Callable[[S], Number]
    labels: tuple[tuple[str, str], ...] = ()


_CONFLICTS = "Merge conflicts at D, by rule (R5 dequeue of a missing message, R6 declare clash)"

# The state machine's counters (cluster.state.model.COUNTERS) exported under
# their own names: counter -> (metric, help, labels).  Every other counter
# becomes drgate_state_outcomes_total{outcome=counter}.
MERGE_METRICS: Mapping[str, tuple[str, str, Mapping[str, str]]] = {
    "r1_duplicates": ("drgate_duplicates_dropped_total",
                      "Replicated commands at or below applied[origin], dropped (R1)", {}),
    "r3_refused": ("drgate_merge_refused_total",
                   "Local writes refused on read-only full replicas (R3)", {"rule": "R3"}),
    "r4_dequeues_ignored": ("drgate_merge_ignored_total",
                            "Remote dequeues not applied to enqueue-mode queues (R4)",
                            {"rule": "R4"}),
    "r5_conflicts": ("drgate_merge_conflicts_total", _CONFLICTS, {"rule": "R5"}),
    "r6_conflicts": ("drgate_merge_conflicts_total", _CONFLICTS, {"rule": "R6"}),
    "r7_fenced": ("drgate_fenced_total", "Commands refused for a stale epoch (R7)", {}),
    "incarnation_refused": ("drgate_incarnation_refused_total",
                            "Replicated commands refused for an unaccepted origin incarnation", {}),
    "replicated_applied": ("drgate_replicated_applied_total",
                           "Replicated commands applied at D", {}),
}  # fmt: skip

_BYTES_SENT = "Event bytes sent on the WAN link: raw (before compression) or wire"
_BYTES_RECEIVED = "Event bytes received on the WAN link: raw (before compression) or wire"
_TLS_REFUSED = (
    "WAN link connections refused for TLS: the handshake failed, or a certificate name "
    "not pinned (tls.peer_names)"
)
_LINK_ROWS: tuple[_Row[LinkSection], ...] = (
    _Row("counter", "drgate_link_bytes_sent_total", _BYTES_SENT,
         lambda s: s.bytes_sent_total, (("encoding", "raw"),)),
    _Row("counter", "drgate_link_bytes_sent_total", _BYTES_SENT,
         lambda s: s.bytes_sent_wire_total, (("encoding", "wire"),)),
    _Row("counter", "drgate_link_batches_sent_total", "Batches sent on the WAN link",
         lambda s: s.batches_sent_total),
    _Row("counter", "drgate_link_events_sent_total", "Events sent on the WAN link",
         lambda s: s.events_sent_total),
    _Row("counter", "drgate_link_bytes_received_total", _BYTES_RECEIVED,
         lambda s: s.bytes_received_total, (("encoding", "raw"),)),
    _Row("counter", "drgate_link_bytes_received_total", _BYTES_RECEIVED,
         lambda s: s.bytes_received_wire_total, (("encoding", "wire"),)),
    _Row("counter", "drgate_link_batches_received_total", "Batches received on the WAN link",
         lambda s: s.batches_received_total),
    _Row("counter", "drgate_link_events_received_total", "Events received on the WAN link",
         lambda s: s.events_received_total),
    _Row("counter", "drgate_link_reconnects_total", "WAN link connections after the first",
         lambda s: s.reconnects_total),
    _Row("counter", "drgate_link_gaps_total", "Gaps in the link stream (D refuses, P resyncs)",
         lambda s: s.gaps_total),
    _Row("gauge", "drgate_site_superseded",
         "P: 1 once the DR site was promoted over this site (the zombie guard is on)",
         lambda s: None if s.superseded_by is None else bool(s.superseded_by)),
    _Row("counter", "drgate_link_refused_total",
         "Events a link peer sent that D does not admit (each closed its link)",
         lambda s: s.refused_total),
    _Row("gauge", "drgate_link_insecure",
         "1 when the WAN link runs in plaintext (insecure: true), 0 with mutual TLS",
         lambda s: None if s.security is None else s.security == "insecure"),
    _Row("counter", "drgate_link_tls_refused_total", _TLS_REFUSED,
         lambda s: s.tls_handshake_failures_total, (("reason", "handshake"),)),
    _Row("counter", "drgate_link_tls_refused_total", _TLS_REFUSED,
         lambda s: s.peer_name_refusals_total, (("reason", "peer_name"),)),
    _Row("gauge", "drgate_link_rtt_seconds", "Last measured WAN round-trip time",
         lambda s: s.rtt_seconds),
    _Row("gauge", "drgate_lag_events", "Events sent or spooled and not yet acked by D",
         lambda s: s.lag_events),
    _Row("gauge", "drgate_lag_seconds",
         "Age of the oldest unacked event (P's commit time to now); 0 when none",
         lambda s: s.lag_seconds),
    _Row("gauge", "drgate_link_acked_seq", "Highest sequence number acked by D",
         lambda s: s.acked_seq),
    _Row("gauge", "drgate_link_last_seq", "Highest sequence number sent or received",
         lambda s: s.last_seq),
    _Row("gauge", "drgate_partitioned",
         "1 in a split brain: the other site is a primary too; replication is parked",
         lambda s: s.partitioned),
)  # fmt: skip

_DR_ROWS: tuple[_Row[DrSection], ...] = (
    _Row("gauge", "drgate_rpo_seconds",
         "D: now minus the P time up to which D holds all of P (what a failover now loses)",
         lambda s: s.rpo_seconds),
    _Row("gauge", "drgate_rpo_events",
         "D: P's last announced seq minus D's applied one (a cseq distance)",
         lambda s: s.rpo_events),
)  # fmt: skip

_SPOOL_ROWS: tuple[_Row[SpoolSection], ...] = (
    _Row("gauge", "drgate_spool_bytes", "Bytes in the spool", lambda s: s.bytes),
    _Row("gauge", "drgate_spool_max_bytes", "The spool's size limit", lambda s: s.max_bytes),
    _Row("gauge", "drgate_spool_segments", "Segment files in the spool", lambda s: s.segments),
    _Row("counter", "drgate_spool_overflow_total",
         "Times a full spool dropped its oldest segments", lambda s: s.overflow_total),
    _Row("gauge", "drgate_spool_first_seq", "Lowest sequence number in the spool",
         lambda s: s.first_seq),
    _Row("gauge", "drgate_spool_last_seq", "Highest sequence number in the spool",
         lambda s: s.last_seq),
    _Row("gauge", "drgate_resync_needed",
         "1 when D is behind the spool's floor and needs a resync", lambda s: s.needs_resync),
    _Row("counter", "drgate_spool_write_errors_total",
         "Spool writes the disk failed (full, I/O error); their events cost D a resync",
         lambda s: s.write_errors_total),
)  # fmt: skip

_RESYNC_ROWS: tuple[_Row[ResyncSection], ...] = (
    _Row("gauge", "drgate_resync_active", "1 while a resync is running", lambda s: s.active),
    _Row("counter", "drgate_resyncs_total", "Resyncs started", lambda s: s.total),
    _Row("gauge", "drgate_resync_progress_ratio",
         "Progress of the running resync, 0 to 1 (P: messages sent; 0 at D)",
         lambda s: s.progress_ratio),
    _Row("gauge", "drgate_resync_chunks_done",
         "Chunks of the running resync acked by D (P) or staged on D's bus (D)",
         lambda s: s.chunks_done),
    _Row("counter", "drgate_resync_bytes_total", "Resync snapshot bytes sent or received",
         lambda s: s.bytes_total),
)  # fmt: skip

_JOURNAL_ROWS: tuple[_Row[JournalSection], ...] = (
    _Row("gauge", "drgate_journal_bytes", "Bytes of the broker's journal on disk",
         lambda s: s.bytes),
    _Row("gauge", "drgate_journal_durable_cseq", "The highest cseq in the journal on disk",
         lambda s: s.durable_cseq),
    _Row("gauge", "drgate_journal_last_checkpoint_cseq", "The cseq of the last checkpoint",
         lambda s: s.last_checkpoint_cseq),
    _Row("gauge", "drgate_journal_last_checkpoint_timestamp_seconds",
         "Unix time of the last checkpoint (0: none yet)", lambda s: s.last_checkpoint_time),
    _Row("counter", "drgate_journal_commits_total", "Group commits of the journal",
         lambda s: s.commits_total),
    _Row("counter", "drgate_journal_fsync_seconds_total", "Time spent in the journal's fdatasync",
         lambda s: s.fsync_seconds_total),
    _Row("gauge", "drgate_journal_fsync_last_seconds", "The last fdatasync's duration",
         lambda s: s.fsync_last_seconds),
)  # fmt: skip

_TRANSFER_ROWS: tuple[_Row[DonationSection], ...] = (
    _Row("counter", "drgate_state_donations_total", "State transfers sent to joining members",
         lambda s: s.sent_total),
    _Row("counter", "drgate_state_donation_bytes_total", "Bytes of the state transfers sent",
         lambda s: s.sent_bytes_total),
    _Row("counter", "drgate_state_donation_saved_bytes_total",
         "Bytes a full transfer would have sent more (bodies left to the joiner's journal)",
         lambda s: s.saved_bytes_total),
    _Row("counter", "drgate_state_donation_bodies_left_total",
         "Message bodies left to the joiners' journals", lambda s: s.bodies_left_total),
    _Row("counter", "drgate_state_delta_fallbacks_total",
         "Delta transfers this node's journal could not fill (a full one followed)",
         lambda s: s.fallbacks_total),
)  # fmt: skip

_RULES_ROWS: tuple[_Row[RulesSection], ...] = (
    _Row("gauge", "drgate_rules_version", "Version of the rules in force", lambda s: s.version),
    _Row("counter", "drgate_rules_reload_failures_total",
         "Rules file changes refused (invalid file)", lambda s: s.failed_reloads_total),
    _Row("gauge", "drgate_rules_file_invalid",
         "1 while the rules file on disk is invalid and the rules in force stay",
         lambda s: bool(s.file_problem)),
)  # fmt: skip


def _number(value: object) -> float | None:
    """The value as a float, or None when it is not a number (bools count as 0/1)."""
    if isinstance(value, bool | int | float):
        return float(value)
    return None


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

    def add(self, kind: str, name: str, doc: str, value: object, labels: Mapping[str, str]) -> None:
        number = _number(value)
        if number is None:
            if value is not None:
                log.debug("metric %s: snapshot value %r is not a number, skipped", name, value)
            return
        family = self._family(kind, name, doc, labels)
        family.add_metric([*self._constant.values(), *labels.values()], number)  # type: ignore[attr-defined]

    def counter(self, name: str, doc: str, value: object, **labels: str) -> None:
        self.add("counter", name, doc, value, labels)

    def gauge(self, name: str, doc: str, value: object, **labels: str) -> None:
        self.add("gauge", name, doc, value, labels)

    def rows(self, rows: Iterable[_Row[S]], section: S) -> None:
        for row in rows:
            self.add(row.kind, row.name, row.doc, row.value(section), dict(row.labels))

    def by_label(self, name: str, doc: str, label: str, counts: Mapping[Any, int]) -> None:
        for key, value in counts.items():
            self.counter(name, doc, value, **{label: str(key)})

    def one_of(self, name: str, doc: str, label: str, current: str, known: tuple[str, ...]) -> None:
        """A 0/1 gauge per known value, 1 for the current one (an unknown current one is added)."""
        for value in known if current in known else (*known, current):
            self.gauge(name, doc, value == current, **{label: value})

    def info(self, name: str, doc: str, value: Mapping[str, str]) -> None:
        family = InfoMetricFamily(name, doc, labels=list(self._constant))
        family.add_metric(list(self._constant.values()), dict(value))
        self._families[name] = family

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


def families_from_snapshot(stats: NodeStatistics) -> list[Metric]:
    """The metric families for one snapshot (a broker's, or a sidecar's with its sections)."""
    out = _Families({"site": stats.site, "node": str(stats.node), "process": stats.process})
    sidecar = stats if isinstance(stats, SidecarStatistics) else None
    if sidecar is not None:
        out.one_of("drgate_role", "1 for this node's current role", "role", sidecar.role, ROLES)

    out.gauge(
        "drgate_bus_cseq", "Commands applied from the site bus (the state's cseq)", stats.cseq
    )
    out.gauge("drgate_bus_view_size", "Members in the current site bus view", stats.bus.view_size)
    out.gauge("drgate_bus_quorate", "1 when the bus view is quorate", stats.bus.quorate)
    out.gauge("drgate_bus_members", "Bus members (brokers and sidecars)", stats.bus.members)

    if sidecar is not None:
        _sidecar_families(out, sidecar)

    for key, count in stats.merge.items():
        if key in MERGE_METRICS:
            name, doc, labels = MERGE_METRICS[key]
            out.counter(name, doc, count, **labels)
        else:
            out.counter(
                "drgate_state_outcomes_total",
                "Other outcomes counted by the site state machine, by counter name",
                count,
                outcome=key,
            )

    if sidecar is not None:
        out.rows(_RESYNC_ROWS, sidecar.resync)
        out.rows(_RULES_ROWS, sidecar.rules)
        if sidecar.rules.digest:
            out.info(
                "drgate_rules", "Digest of the rules in force", {"digest": sidecar.rules.digest}
            )

    if stats.journal is not None:
        out.rows(_JOURNAL_ROWS, stats.journal)
    if stats.transfers is not None:
        out.rows(_TRANSFER_ROWS, stats.transfers)

    if stats.state_transfer is not None:
        transfer = stats.state_transfer
        out.counter(
            "drgate_state_transfers_total",
            "State transfers received at start-up",
            transfer.count_total,
        )
        out.counter(
            "drgate_state_transfer_seconds_total",
            "Time spent in state transfers",
            transfer.seconds_total,
        )

    # The text itself is unbounded: it is in /status, the metric only says "there is one".
    out.gauge(
        "drgate_last_error_present", "1 when the node reports an error", bool(stats.last_error)
    )
    return list(out)


def _sidecar_families(out: _Families, stats: SidecarStatistics) -> None:
    """The tap, link and spool families (what a broker does not have)."""
    if stats.tap is not None:
        tap = stats.tap
        out.by_label(
            "drgate_tap_commands_total",
            "Bus commands seen by the tap, by command kind",
            "kind",
            tap.commands_total,
        )
        out.by_label(
            "drgate_events_forwarded_total",
            "Replication events produced by the tap, by replication mode",
            "mode",
            tap.forwarded_total,
        )
        for (mode, rule), value in tap.filtered_total.items():
            out.counter(
                "drgate_events_filtered_total",
                "Commands not forwarded because of the rules, by mode and deciding rule",
                value,
                mode=mode,
                rule=rule,
            )
        out.by_label(
            "drgate_events_dropped_total",
            "Events dropped by the sidecar, by reason",
            "reason",
            tap.dropped_total,
        )

    link = stats.link
    out.gauge("drgate_link_up", "1 when the WAN link is up", link.state == "up")
    out.one_of(
        "drgate_link_state", "1 for the WAN link's current state", "state", link.state, LINK_STATES
    )
    if link.peer:
        out.info("drgate_link_peer", "The WAN link's peer address", {"peer": link.peer})
    out.rows(_LINK_ROWS, link)

    if stats.spool is not None:
        out.rows(_SPOOL_ROWS, stats.spool)
    if stats.dr is not None:
        out.rows(_DR_ROWS, stats.dr)
        verify = stats.dr.verify
        if verify is not None:
            out.counter(
                "drgate_verify_checks_total",
                "D: replicas compared with P at a verification point",
                verify.checks_total,
            )
            out.counter(
                "drgate_verify_mismatches_total",
                "D: comparisons that found a replica different from P",
                verify.mismatches_total,
            )
            for queue, result in verify.queues.items():
                out.gauge(
                    "drgate_verify_mismatch",
                    "D: 1 while the replica's last comparison with P found a difference",
                    not result["ok"],
                    queue=queue,
                )


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
