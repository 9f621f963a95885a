"""The site's deterministic queue state machine (docs/architecture.md, sections 5, 6).

``new_state()`` makes an empty site; ``apply(state, command, sender=...)``
applies one bus command and returns effects; ``members_left`` handles a view
change; ``snapshot``/``restore`` move a state between members; ``digest``
compares them; ``fenced`` (R7) and ``read_only_origin`` (R3) answer the merge
rules other layers ask about (:mod:`cluster.state.merge`).  docs/state.md
describes the rules as implemented.
"""

from __future__ import annotations

from cluster.state.digests import content_digest, queue_digest
from cluster.state.effects import (
    CONDITIONS,
    Conflict,
    Delivered,
    Dequeued,
    Effect,
    Enqueued,
    GenesisApplied,
    IncarnationAccepted,
    Message,
    Outcome,
    Promoted,
    QueueDeclared,
    QueueDeleted,
    Reason,
    Refused,
    Released,
    ReplicatedOutcome,
    Sender,
    Settled,
    Verified,
)
from cluster.state.machine import apply, apply_all, recovery_loses_history
from cluster.state.merge import fenced, read_only_origin
from cluster.state.model import (
    COUNTERS,
    Recovery,
    SiteState,
    new_state,
    session_id,
    session_owner,
    topic_matches,
)
from cluster.state.sessions import members_left
from cluster.state.snapshots import (
    DeltaSnapshot,
    ElidedBodyMismatch,
    delta_snapshot,
    digest,
    held_ranges,
    restore,
    restore_untrusted,
    snapshot,
)
from cluster.state.views import (
    ExchangeInfo,
    OriginInfo,
    QueueInfo,
    applied,
    list_exchanges,
    list_queues,
    messages,
    origin_info,
    queue_args,
    queue_info,
    ready_members,
    replica_mode,
    route,
    session_holdings,
    statistics,
)

__all__ = [
    "CONDITIONS",
    "COUNTERS",
    "Conflict",
    "Delivered",
    "DeltaSnapshot",
    "Dequeued",
    "Effect",
    "ElidedBodyMismatch",
    "Enqueued",
    "ExchangeInfo",
    "GenesisApplied",
    "IncarnationAccepted",
    "Message",
    "OriginInfo",
    "Outcome",
    "Promoted",
    "QueueDeclared",
    "QueueDeleted",
    "QueueInfo",
    "Reason",
    "Recovery",
    "Refused",
    "Released",
    "ReplicatedOutcome",
    "Sender",
    "Settled",
    "SiteState",
    "Verified",
    "applied",
    "apply",
    "apply_all",
    "content_digest",
    "delta_snapshot",
    "digest",
    "fenced",
    "held_ranges",
    "list_exchanges",
    "list_queues",
    "members_left",
    "messages",
    "new_state",
    "origin_info",
    "queue_args",
    "queue_digest",
    "queue_info",
    "read_only_origin",
    "ready_members",
    "recovery_loses_history",
    "replica_mode",
    "restore",
    "restore_untrusted",
    "route",
    "session_holdings",
    "session_id",
    "session_owner",
    "snapshot",
    "statistics",
    "topic_matches",
]
