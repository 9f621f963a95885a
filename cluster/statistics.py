"""The broker's statistics snapshot: frozen, typed, plain data.

A node hands out a :class:`NodeStatistics` from ``statistics()``; the gateway
(``gateway/metrics.py``) turns it into Prometheus metrics and the ``/status``
document at scrape time, so nothing here imports prometheus-client and nothing
on the hot path builds a snapshot.  The sidecar's snapshot extends this one
(``gateway/statistics.py``).  A field that a node does not report is ``None``
and its metric is absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BusSection:
    """The site bus as this node sees it."""

    view_size: int  # members in the current view
    quorate: bool
    members: int | None = None  # ready brokers and sidecars in the state (brokers report it)


@dataclass(frozen=True, slots=True)
class StateTransferSection:
    """State transfers received at start-up."""

    count_total: int
    seconds_total: float


@dataclass(frozen=True, slots=True)
class DonationSection:
    """State transfers a broker sent to joiners and took itself; a joiner that
    restarted with its journal takes a delta (docs/broker.md, "Durability")."""

    sent_total: int  # snapshots sent to joiners
    sent_bytes_total: int
    saved_bytes_total: int  # bytes the joiners' journals held instead
    bodies_left_total: int  # message bodies left to the joiners' journals
    received_total: int  # snapshots taken by this node
    received_bytes_total: int
    fallbacks_total: int  # deltas this node's journal could not fill


@dataclass(frozen=True, slots=True)
class JournalSection:
    """A broker's journal (cluster/journal.py)."""

    bytes: int  # on disk: checkpoint and segments
    durable_cseq: int  # the highest cseq on disk
    last_checkpoint_cseq: int
    last_checkpoint_time: float  # Unix time; 0 before the first
    commits_total: int
    fsync_seconds_total: float
    fsync_last_seconds: float


@dataclass(frozen=True, slots=True)
class NodeStatistics:
    """One snapshot of a bus member: the constant labels, the bus, the state's counters.

    ``process`` is ``"broker"`` or ``"sidecar"``; ``merge`` holds the state
    machine's counters by name (``cluster.state.model.COUNTERS``);
    ``last_error`` is ``""`` when the node reports no error.
    """

    site: str
    node: int
    process: str
    cseq: int  # commands applied from the site bus
    bus: BusSection
    merge: Mapping[str, int]
    last_error: str
    state_transfer: StateTransferSection | None = None
    journal: JournalSection | None = None
    transfers: DonationSection | None = None
