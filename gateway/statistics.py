"""The sidecar's statistics snapshot: frozen, typed sections, and their assembly.

A sidecar hands out a :class:`SidecarStatistics` from ``statistics()``;
``gateway/metrics.py`` turns it into Prometheus metrics and the ``/status``
document at scrape time.  ``SidecarStatistics`` *extends*
:class:`cluster.statistics.NodeStatistics` (inheritance, not composition), so
the metrics read the common fields of a broker's and a sidecar's snapshot the
same way and add the sidecar's sections when ``isinstance(stats,
SidecarStatistics)``.  Its own fields are keyword-only.

Sections a role does not have are ``None``: ``tap`` and ``spool`` at the
egress side (P) only, ``dr`` at the ingress side (D) only.  In ``link``, the
fields after ``rtt_seconds`` are ``None`` when this side does not count them
(P sends, D receives); a ``None`` field is an absent metric.

The functions below build the sections from the components' own snapshots;
:func:`sidecar_statistics` assembles the whole.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.statistics import BusSection, NodeStatistics, StateTransferSection
from gateway.recoverypoint import recovery_point
from gateway.resync import origin_summary
from gateway.roles import SidecarRole
from gateway.verification import VerifySection

if TYPE_CHECKING:
    from cluster.state.model import SiteState
    from gateway.sidecar import Sidecar
    from gateway.spool import SpoolStatistics
    from protocol.link.receiver import ReceiverStatistics
    from protocol.link.sender import SenderStatistics

__all__ = [
    "BusSection",
    "DrSection",
    "LinkSection",
    "NodeStatistics",
    "ResyncSection",
    "RulesSection",
    "SidecarStatistics",
    "SpoolSection",
    "StateTransferSection",
    "TapStatistics",
    "dr_section",
    "egress_link_section",
    "ingress_link_section",
    "sidecar_statistics",
    "spool_section",
]


@dataclass(frozen=True, slots=True)
class TapStatistics:
    """The tap's counters (``Tap.statistics()``)."""

    commands_total: Mapping[str, int]  # bus commands seen, by command kind
    forwarded_total: Mapping[str, int]  # replication events produced, by mode
    filtered_total: Mapping[tuple[str, str], int]  # not forwarded, by (mode, deciding rule)
    dropped_total: Mapping[str, int]  # dropped, by reason
    paused: tuple[str, ...] = ()  # queues whose replication is paused (drgate replicate pause)


@dataclass(frozen=True, slots=True)
class LinkSection:
    """The WAN link.  ``*_sent_*`` are counted at P, ``*_received_*`` at D."""

    state: str  # "up", "down", "connecting", "refused"
    peer: str  # "" before the first connection
    reconnects_total: int
    rtt_seconds: float | None
    acked_seq: int | None = None
    last_seq: int | None = None
    lag_events: int | None = None  # P: events tapped and not acked by D
    lag_seconds: float | None = None  # P: age of the oldest of them
    bytes_sent_total: int | None = None  # event bytes before compression
    bytes_sent_wire_total: int | None = None
    batches_sent_total: int | None = None
    events_sent_total: int | None = None
    bytes_received_wire_total: int | None = None
    batches_received_total: int | None = None
    events_received_total: int | None = None
    # Event bytes received before decompression.  No sidecar counts it today;
    # the metric family drgate_link_bytes_received_total{encoding="raw"} is
    # documented beside the wire one, so the field stays.
    bytes_received_total: int | None = None
    # Discontinuities in the stream: refused by D's receiver (D), answered by
    # a resync (P).
    gaps_total: int | None = None
    # D: events a link peer sent that D does not admit (gateway/admission.py);
    # each one closed its connection.
    refused_total: int | None = None
    # P: the DR site that was promoted over this one ("" while none was);
    # the zombie guard refuses publishes from then on.
    superseded_by: str | None = None
    # P: after a failback, its cseq while the replicated queues give consumers
    # nothing until D acknowledges it (cluster/state/switchover.py); 0: none.
    failback_wait_cseq: int | None = None
    # "mutual-tls", or "insecure" when the config runs the link in plaintext.
    security: str | None = None
    # Connections refused for TLS reasons: the handshake failed (no or a
    # foreign certificate, a plaintext peer), or a certificate name that is
    # not pinned (refused by either side).
    tls_handshake_failures_total: int | None = None
    peer_name_refusals_total: int | None = None
    # Split brain: the other site is a primary too (P: D refused this link as
    # PARTITIONED; D: that primary's egress keeps knocking); both park.
    partitioned: bool | None = None


@dataclass(frozen=True, slots=True)
class SpoolSection:
    """The egress spool (P)."""

    bytes: int
    max_bytes: int
    segments: int
    overflow_total: int  # times a full spool dropped its oldest segments
    needs_resync: bool  # D is behind the spool's floor
    first_seq: int | None
    last_seq: int | None
    write_errors_total: int = 0  # failed spool writes (disk full, I/O error): D resyncs


@dataclass(frozen=True, slots=True)
class ResyncSection:
    """Resyncs: started, running, progress (P: messages sent of the snapshot's;
    chunks acked by D at P, staged on D's bus at D)."""

    active: bool
    total: int
    progress_ratio: float
    bytes_total: int
    messages: int
    chunks_done: int = 0
    messages_kept: int = 0  # a failback by delta: not sent, the peer held them
    bytes_kept: int = 0


@dataclass(frozen=True, slots=True)
class RulesSection:
    """The replication rules in force and the rules file on disk."""

    version: int
    failed_reloads_total: int
    file_problem: str  # "" while the file on disk is valid
    digest: str


@dataclass(frozen=True, slots=True)
class DrSection:
    """What D holds of the origins (D only): read by the Pacemaker agent and ``drgate status``.

    ``promoted`` and ``epoch`` are those of the peer site P.  ``origins`` is
    ``gateway.resync.origin_summary`` of every origin, by site name.
    """

    promoted: bool
    epoch: int
    origins: Mapping[str, Mapping[str, object]]
    # P's recovery point seen from D (gateway/recoverypoint.py): None while
    # D holds nothing of P, or was promoted over it.
    rpo_seconds: float | None = None
    rpo_events: int | None = None
    # The last comparison of each replica with P (gateway/verification.py).
    verify: VerifySection | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SidecarStatistics(NodeStatistics):
    """A sidecar's snapshot: a :class:`NodeStatistics` with ``process="sidecar"`` and its sections.

    ``role`` is one of ``gateway.metrics.ROLES`` (a ``StrEnum`` fits).
    """

    role: str
    rules: RulesSection
    link: LinkSection
    resync: ResyncSection
    tap: TapStatistics | None
    spool: SpoolSection | None
    dr: DrSection | None


def spool_section(stats: SpoolStatistics) -> SpoolSection:
    """The spool's section of its own snapshot."""
    return SpoolSection(
        bytes=stats.bytes,
        max_bytes=stats.max_bytes,
        segments=stats.segments,
        overflow_total=stats.overflow_count,
        needs_resync=stats.needs_resync,
        first_seq=stats.first_seq,
        last_seq=stats.last_seq,
        write_errors_total=stats.write_errors,
    )


def egress_link_section(
    *,
    state: str,
    peer: str,
    reconnects_total: int,
    rtt_seconds: float | None,
    acked_seq: int,
    lag: tuple[int, float],
    spool: SpoolStatistics | None,
    sender: SenderStatistics | None,
    ended: Mapping[str, int],
    gaps_total: int = 0,
    superseded_by: str = "",
    failback_wait_cseq: int = 0,
    security: str | None = None,
    tls_refused: Mapping[str, int] | None = None,
    partitioned: bool = False,
) -> LinkSection:
    """P's link: ``sender`` is the open connection's snapshot (``None`` when
    none is open), ``ended`` the summed counters of the connections that ended
    (keys ``bytes_sent_total``, ``bytes_sent_wire_total``, ``batches_sent_total``,
    ``events_sent_total``; a missing key is 0), so the totals never go back.
    ``last_seq`` is the highest seq the spool covers (its last event, or its
    floor when a resync cut or a join point lies above it; 0 without a
    spool), so a converged link has ``acked_seq == last_seq``; ``lag`` is
    (events, seconds).
    ``tls_refused`` counts TLS refusals by reason (``handshake``, ``peer_name``)."""
    last = 0 if spool is None else spool.held_upto
    return LinkSection(
        state=state,
        peer=peer,
        reconnects_total=reconnects_total,
        rtt_seconds=rtt_seconds,
        acked_seq=acked_seq,
        last_seq=last,
        lag_events=lag[0],
        lag_seconds=lag[1],
        bytes_sent_total=ended.get("bytes_sent_total", 0) + (sender.bytes_raw if sender else 0),
        bytes_sent_wire_total=ended.get("bytes_sent_wire_total", 0)
        + (sender.bytes_sent if sender else 0),
        batches_sent_total=ended.get("batches_sent_total", 0) + (sender.batches if sender else 0),
        events_sent_total=ended.get("events_sent_total", 0) + (sender.events if sender else 0),
        gaps_total=gaps_total,
        superseded_by=superseded_by,
        failback_wait_cseq=failback_wait_cseq,
        partitioned=partitioned,
        **_tls_fields(security, tls_refused),
    )


def _tls_fields(security: str | None, refused: Mapping[str, int] | None) -> dict[str, Any]:
    if refused is None:
        return {"security": security}
    return {
        "security": security,
        "tls_handshake_failures_total": refused.get("handshake", 0),
        "peer_name_refusals_total": refused.get("peer_name", 0),
    }


def ingress_link_section(
    *,
    state: str,
    peer: str,
    reconnects_total: int,
    rtt_seconds: float | None,
    events_received_total: int,
    receivers: Collection[ReceiverStatistics],
    ended: Mapping[str, int],
    refused_total: int = 0,
    security: str | None = None,
    tls_refused: Mapping[str, int] | None = None,
    partitioned: bool = False,
) -> LinkSection:
    """D's link: ``receivers`` are the open connections' snapshots, ``ended``
    the summed counters of those that ended (keys ``bytes_received_wire_total``,
    ``batches_received_total``, ``gaps_total``; a missing key is 0).  ``acked_seq`` is the
    highest of the open connections, ``None`` with none open."""
    return LinkSection(
        state=state,
        peer=peer,
        reconnects_total=reconnects_total,
        rtt_seconds=rtt_seconds,
        acked_seq=max((r.acked_seq for r in receivers), default=None),
        events_received_total=events_received_total,
        bytes_received_wire_total=ended.get("bytes_received_wire_total", 0)
        + sum(r.bytes_received for r in receivers),
        batches_received_total=ended.get("batches_received_total", 0)
        + sum(r.batches for r in receivers),
        gaps_total=ended.get("gaps_total", 0) + sum(r.gaps for r in receivers),
        refused_total=refused_total,
        partitioned=partitioned,
        **_tls_fields(security, tls_refused),
    )


def dr_section(
    state: SiteState,
    *,
    peer_cluster: str,
    now_us: int | None = None,
    verify: VerifySection | None = None,
) -> DrSection:
    """D's view of the origins in ``state``; ``peer_cluster`` is P's site name
    (not promoted, epoch 0 while D holds nothing of it), whose recovery point
    at ``now_us`` (default: now) it reports."""
    now_us = int(time.time() * 1e6) if now_us is None else now_us
    peer = state.origins.get(peer_cluster)
    rpo_seconds, rpo_events = recovery_point(state, peer_cluster, now_us)
    return DrSection(
        promoted=bool(peer is not None and peer.promoted),
        epoch=0 if peer is None else peer.epoch,
        origins={name: origin_summary(o, now_us) for name, o in state.origins.items()},
        rpo_seconds=rpo_seconds,
        rpo_events=rpo_events,
        verify=verify,
    )


def sidecar_statistics(
    *,
    site: str,
    node: int,
    role: str,
    cseq: int,
    bus: BusSection,
    merge: Mapping[str, int],
    last_error: str,
    rules: RulesSection,
    link: LinkSection,
    resync: ResyncSection,
    tap: TapStatistics | None = None,
    spool: SpoolStatistics | None = None,
    dr: DrSection | None = None,
) -> SidecarStatistics:
    """A sidecar's snapshot from its pieces; ``merge`` is copied, ``spool`` converted."""
    return SidecarStatistics(
        site=site,
        node=node,
        process="sidecar",
        cseq=cseq,
        bus=bus,
        merge=dict(merge),
        last_error=last_error,
        role=role,
        rules=rules,
        link=link,
        resync=resync,
        tap=tap,
        spool=None if spool is None else spool_section(spool),
        dr=dr,
    )


def sidecar_snapshot(sidecar: Sidecar) -> SidecarStatistics:
    """``sidecar``'s snapshot, which metrics and ``/status`` read (gateway/metrics.py)."""
    membership = sidecar.member.membership
    role = sidecar.current_role()
    link_side = sidecar.link_side
    resync = link_side.status.resync
    return sidecar_statistics(
        site=sidecar.config.site,
        node=sidecar.config.node,
        role=role,
        cseq=sidecar.state.cseq,
        bus=BusSection(
            view_size=0 if membership is None else len(membership.members),
            quorate=True if membership is None else membership.quorate,
        ),
        merge=sidecar.state.counters,
        last_error=(
            sidecar.minority_text_now()
            if role == SidecarRole.MINORITY
            else link_side.status.last_error
            or sidecar.tap.last_error
            or sidecar.rules_watch.problem
            or (sidecar.peers_watch.problem if sidecar.peers_watch else "")
        ),
        rules=RulesSection(
            version=sidecar.tap.rules.rules_version,
            failed_reloads_total=sidecar.tap.rules_failures + sidecar.rules_watch.failures,
            file_problem=sidecar.rules_watch.problem,
            digest=sidecar.tap.rules.digest,
        ),
        link=link_side.link_statistics(),
        resync=ResyncSection(
            active=resync.active,
            total=resync.total,
            progress_ratio=resync.progress_ratio,
            bytes_total=resync.bytes_total,
            messages=resync.messages,
            chunks_done=resync.chunks_done,
            messages_kept=resync.messages_kept,
            bytes_kept=resync.bytes_kept,
        ),
        tap=sidecar.tap.statistics() if sidecar.primary else None,
        spool=None if sidecar.spool is None else sidecar.spool.statistics(),
        dr=None
        if sidecar.primary
        else dr_section(
            sidecar.state,
            peer_cluster=sidecar.config.peer_cluster,
            verify=sidecar.verifications.section(),
        ),
    )
