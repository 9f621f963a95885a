"""What a broker node reports to the observability endpoint: its
:class:`~cluster.statistics.NodeStatistics`, assembled from the node, its
member and its journal (gateway/metrics.py turns it into metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.statistics import BusSection, DonationSection, JournalSection, NodeStatistics

if TYPE_CHECKING:
    from cluster.node import BrokerNode


def broker_statistics(node: BrokerNode) -> NodeStatistics:
    """A typed snapshot for the observability endpoint (read by gateway/metrics.py).

    Only plain data: the gateway turns it into Prometheus metrics; this
    module does not import prometheus-client.  A broker has no role, tap,
    link or spool, and reports no state transfer.
    """
    membership = node.member.membership
    state = node.member.state
    return NodeStatistics(
        site=node.config.cluster,
        node=node.config.node,
        process="broker",
        cseq=state.cseq,
        bus=BusSection(
            view_size=0 if membership is None else len(membership.members),
            quorate=True if membership is None else membership.quorate,
            members=len(state.ready),
        ),
        merge=dict(state.counters),
        last_error="" if node.quorate() else node.minority_refusal(),
        journal=None if node.durability is None else _journal_section(node),
        transfers=_transfers_section(node),
    )


def _transfers_section(node: BrokerNode) -> DonationSection:
    t = node.member.transfers
    return DonationSection(
        sent_total=t.donations,
        sent_bytes_total=t.bytes_sent,
        saved_bytes_total=t.bytes_saved,
        bodies_left_total=t.bodies_left,
        received_total=t.restores,
        received_bytes_total=t.bytes_received,
        fallbacks_total=t.fallbacks,
    )


def _journal_section(node: BrokerNode) -> JournalSection:
    assert node.durability is not None
    j = node.durability.statistics()
    return JournalSection(
        bytes=j.bytes_on_disk,
        durable_cseq=j.durable_cseq,
        last_checkpoint_cseq=j.last_checkpoint_cseq,
        last_checkpoint_time=j.last_checkpoint_time or 0.0,
        commits_total=j.commits,
        fsync_seconds_total=j.fsync_seconds_total,
        fsync_last_seconds=j.fsync_last_seconds,
    )
