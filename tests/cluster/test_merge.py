"""The merge rules decided once (cluster/state/merge): R3, R7, admission, bookkeeping."""

from __future__ import annotations

import pytest

from cluster.state import Outcome, fenced, new_state, read_only_origin
from cluster.state.merge import admit, origin_record, record_applied
from cluster.state.model import Origin, Queue, Replica, SiteState
from protocol.modes import Mode


def origin(epoch: int, promoted: bool = False, incarnation: int = 0) -> Origin:
    o = Origin("P")
    o.epoch, o.promoted, o.incarnation = epoch, promoted, incarnation
    return o


@pytest.mark.parametrize(
    ("epoch", "accepted", "promoted", "expected"),
    [
        (1, 2, False, True),  # below the accepted epoch: stale
        (2, 2, False, False),
        (3, 2, False, True),  # above it: only the operator moves the epoch
        (5, 0, False, False),  # nothing accepted yet: the first stream sets it
        (2, 2, True, True),  # the epoch this site was promoted at
        (3, 2, True, True),  # a promotion fences every epoch (AcceptPrimary lifts it)
        (1, 2, True, True),
    ],
)
def test_r7_fences_any_other_epoch_and_everything_after_a_promotion(
    epoch: int, accepted: int, promoted: bool, expected: bool
) -> None:
    assert fenced(origin(accepted, promoted), epoch) is expected


def test_r7_fences_nothing_from_an_unknown_origin() -> None:
    assert fenced(None, 0) is False


def site_with(queue: Queue, *origins: Origin) -> SiteState:
    state = new_state()
    state.queues[queue.name] = queue
    for o in origins:
        state.origins[o.name] = o
    return state


@pytest.mark.parametrize(
    ("replica", "promoted", "expected"),
    [
        (None, False, None),  # a local queue
        (Replica("P", Mode.ENQUEUE), False, None),
        (Replica("P", Mode.WIRING), False, None),
        (Replica("P", Mode.FULL), False, "P"),
        (Replica("P", Mode.FULL), True, None),  # promoted over P here
    ],
)
def test_r3_only_a_full_replica_of_an_origin_not_promoted_over_is_read_only(
    replica: Replica | None, promoted: bool, expected: str | None
) -> None:
    state = site_with(Queue("q", {}, replica), origin(1, promoted))
    assert read_only_origin(state, state.queues["q"]) == expected


def test_r3_a_full_replica_of_an_origin_with_no_record_is_read_only() -> None:
    state = site_with(Queue("q", {}, Replica("X", Mode.FULL)))
    assert read_only_origin(state, state.queues["q"]) == "X"


def d_site() -> SiteState:
    state = new_state()
    state.cluster = "D"
    return state


def test_admission_refuses_in_order_and_counts_each_refusal() -> None:
    state = d_site()
    assert admit(state, "D", 1, 1, 1) is Outcome.OWN_ORIGIN
    assert "D" not in state.origins
    assert admit(state, "P", 7, 1, 1) is None
    record_applied(state, "P", 7, 5, 2, 1_000)
    # Fencing is checked before the incarnation, the incarnation before R1.
    assert admit(state, "P", 8, 1, 1) is Outcome.FENCED
    assert admit(state, "P", 8, 9, 2) is Outcome.INCARNATION
    assert state.origins["P"].refused_incarnation == 8
    assert admit(state, "P", 7, 5, 2) is Outcome.DUPLICATE
    assert admit(state, "P", 7, 6, 2) is None
    counters = state.counters
    assert (
        counters["own_origin_refused"],
        counters["r7_fenced"],
        counters["incarnation_refused"],
        counters["r1_duplicates"],
        counters["replicated_applied"],
    ) == (1, 1, 1, 1, 1)


def test_admission_changes_no_record_but_creates_it() -> None:
    state = d_site()
    assert admit(state, "P", 7, 0, 1) is Outcome.DUPLICATE
    o = state.origins["P"]
    assert (o.incarnation, o.epoch, o.applied) == (0, 0, {})


def test_bookkeeping_accepts_the_incarnation_and_a_first_epoch() -> None:
    state = d_site()
    o = origin_record(state, "P")
    o.refused_incarnation = 9
    state.cseq = 40
    record_applied(state, "P", 9, 12, 3, 5_000)
    assert (o.incarnation, o.refused_incarnation, o.epoch, o.promoted) == (9, 0, 3, False)
    assert (o.applied, o.last_time_us, o.last_cseq) == ({9: 12}, 5_000, 40)
    record_applied(state, "P", 9, 13, 4, 6_000)  # only the operator moves an epoch
    assert (o.epoch, o.applied[9]) == (3, 13)
