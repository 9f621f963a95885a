"""A sidecar's spool over its life: opened at the join point (or, at a
planned switchover's swap, just below the new primary's first event), set
aside when it belongs to another history, discarded when the site stops
being the primary or its state goes stale (gateway/sidecar.py).

The spool itself (segments, floor, trimming) is :mod:`gateway.spool`; this
module decides only where it starts and what a whole-site recovery the
spool did not see means for D."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cluster.state.model import Recovery, SiteState
from gateway.spool import DEFAULT_SEGMENT_BYTES, Spool

if TYPE_CHECKING:
    from gateway.sidecarconfig import SidecarConfig


def open_spool(config: SidecarConfig, state: SiteState, *, start_after: int | None = None) -> Spool:
    """The spool, holding every event above ``start_after`` (default: the
    current cseq, the join point: what it held below is kept, what lies
    between is a resync for D); one of another incarnation, or holding
    events of a history a whole-site recovery did not continue, is set
    aside."""
    return Spool.open(
        config.spool_dir,
        max_bytes=config.spool_max_bytes,
        # A small spool gets small segments, so an overflow drops little.
        segment_bytes=min(DEFAULT_SEGMENT_BYTES, config.spool_max_bytes // 8),
        fsync=config.fsync,
        incarnation=state.incarnation,
        start_after=state.cseq if start_after is None else start_after,
        recoveries=[r.cseq for r in state.recoveries],
    )


def missed_recoveries(spool: Spool, state: SiteState) -> list[Recovery]:
    """The whole-site recoveries that dropped transient state D may hold and
    that ``spool`` did not see, so that it may resume D seamlessly below
    their point: D must be resynced at a cut after them, whether or not this
    sidecar took part (docs/architecture.md, "Durability").  A new spool saw
    every recovery before its join point."""
    seen = spool.written_under
    if seen is None:
        seen = sum(1 for r in state.recoveries if r.cseq < state.cseq)
    return [r for r in state.recoveries[seen:] if r.dropped]


def discard_spool(spool: Spool | None, directory: str) -> None:
    """Close ``spool`` and delete the files of ``directory``: events nobody
    will ask for (a stale minority's, or a site that is not the primary now)."""
    if spool is None:
        return
    spool.close()
    for path in Path(directory).iterdir():
        if path.is_file():
            path.unlink()
