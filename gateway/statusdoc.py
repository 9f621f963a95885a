"""The ``/status`` JSON document of one typed statistics snapshot (the fields
are listed in docs/observability.md; :mod:`gateway.metrics` makes the
Prometheus metrics of the same snapshot)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from cluster.statistics import NodeStatistics
from gateway.metrics import RATE_COUNTERS
from gateway.statistics import SidecarStatistics
from gateway.verification import VerifySection


def _plain(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become None."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def status_document(
    stats: NodeStatistics, rates: Mapping[str, float | None] | None = None
) -> dict[str, Any]:
    """The ``/status`` JSON for one snapshot (fields listed in docs/observability.md).

    A broker's document has ``None`` for the sidecar's fields.  Compatibility
    fields, kept as they were when snapshots were dicts: ``bus.members`` is
    absent (not ``null``) when the node does not report it, and at D
    ``resync.promoted`` and ``resync.epoch`` come from the ``dr`` section
    (the Pacemaker agent and ``drgate status`` read them there).
    """
    sidecar = stats if isinstance(stats, SidecarStatistics) else None
    link = sidecar.link if sidecar else None
    spool = sidecar.spool if sidecar else None
    rules = sidecar.rules if sidecar else None
    bus: dict[str, Any] = {"view_size": stats.bus.view_size, "quorate": stats.bus.quorate}
    if stats.bus.members is not None:
        bus["members"] = stats.bus.members
    resync: dict[str, Any] = dataclasses.asdict(sidecar.resync) if sidecar else {}
    if sidecar is not None and sidecar.dr is not None:
        resync.update(promoted=sidecar.dr.promoted, epoch=sidecar.dr.epoch)
    doc: dict[str, Any] = {
        "site": stats.site,
        "node": stats.node,
        "process": stats.process,
        "role": str(sidecar.role) if sidecar else None,
        "peer": link.peer if link else None,
        "link_state": link.state if link else None,
        "link_security": link.security if link else None,
        "lag_events": link.lag_events if link else None,
        "lag_seconds": link.lag_seconds if link else None,
        "rtt_seconds": link.rtt_seconds if link else None,
        "acked_seq": link.acked_seq if link else None,
        "last_seq": link.last_seq if link else None,
        "link_gaps_total": link.gaps_total if link else None,
        "link_refused_total": link.refused_total if link else None,
        "superseded_by": link.superseded_by if link else None,
        "failback_wait_cseq": link.failback_wait_cseq if link else None,
        "partitioned": link.partitioned if link else None,
        "rpo_seconds": sidecar.dr.rpo_seconds if sidecar and sidecar.dr else None,
        "rpo_events": sidecar.dr.rpo_events if sidecar and sidecar.dr else None,
        "rates": dict(rates) if rates is not None else {key: None for key, _ in RATE_COUNTERS},
        "spool": {
            "bytes": spool.bytes if spool else None,
            "max_bytes": spool.max_bytes if spool else None,
            "used_ratio": spool.bytes / spool.max_bytes if spool and spool.max_bytes else None,
            "segments": spool.segments if spool else None,
            "overflow_total": spool.overflow_total if spool else None,
            "needs_resync": spool.needs_resync if spool else None,
            "write_errors_total": spool.write_errors_total if spool else None,
        },
        "rules_version": rules.version if rules else None,
        "rules_digest": rules.digest if rules else None,
        "rules_file_problem": rules.file_problem if rules else "",
        "rules_reload_failures": rules.failed_reloads_total if rules else None,
        "paused_queues": list(sidecar.tap.paused) if sidecar and sidecar.tap else None,
        "verify": _verify(sidecar.dr.verify if sidecar and sidecar.dr else None),
        "bus": bus,
        "resync": resync,
        "journal": None if stats.journal is None else dataclasses.asdict(stats.journal),
        "transfers": None if stats.transfers is None else dataclasses.asdict(stats.transfers),
        "merge": dict(stats.merge),
        "last_error": stats.last_error,
    }
    return _plain(doc)  # type: ignore[no-any-return]


def _verify(section: VerifySection | None) -> dict[str, Any] | None:
    """D: the last comparison of each replica with P (gateway/verification.py)."""
    if section is None:
        return None
    return {
        "queues": section.queues,
        "mismatched": section.mismatched,
        "checks_total": section.checks_total,
        "mismatches_total": section.mismatches_total,
    }
