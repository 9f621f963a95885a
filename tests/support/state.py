"""Building ``cluster.state`` site states in tests, without a bus."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.state import SiteState, apply, new_state
from protocol import cluster as pc


@dataclass(frozen=True, slots=True)
class Member:
    """A command's sender as ``cluster.state.apply`` reads it: node and pid."""

    node: int
    pid: int


def genesis_state(site: str, incarnation: int) -> SiteState:
    """A new site state that has applied ``Genesis(site, incarnation)``."""
    state = new_state()
    apply(state, pc.Genesis(site, incarnation))
    return state
