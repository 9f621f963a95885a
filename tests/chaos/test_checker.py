"""The chaos checker finds each kind of divergence, and passes a clean run."""

from __future__ import annotations

from tests.chaos.checker import ACCEPTED, IN_DOUBT, Delivery, QueueRecord, check


def enq(**changes: object) -> QueueRecord:
    """q: 1..4 accepted, 5 in doubt, 6 refused; D took 1, 2 and holds 3, 4."""
    record = QueueRecord("q", "enqueue")
    record.published = {f"q-{n}": ACCEPTED for n in range(1, 5)}
    record.published |= {"q-5": IN_DOUBT, "q-6": "rejected"}
    record.p_final = [f"q-{n}" for n in range(1, 5)]
    record.d_deliveries = [Delivery("q-1", 1, False), Delivery("q-2", 1, False)]
    record.d_final = ["q-3", "q-4"]
    for key, value in changes.items():
        setattr(record, key, value)
    return record


def test_a_clean_enqueue_queue_passes() -> None:
    assert check([enq()]) == []


def test_a_message_in_doubt_may_be_at_d_once() -> None:
    assert check([enq(d_final=["q-3", "q-4", "q-5"])]) == []


def test_a_lost_message_is_named() -> None:
    assert check([enq(d_final=["q-4"])]) == ["q at D: q-3 accepted at P is lost (1 lost in all)"]


def test_a_message_applied_twice_at_d_is_named() -> None:
    problems = check([enq(d_final=["q-2", "q-3", "q-4"])])
    assert "q at D: q-2 consumed (connection 1) and still held" in problems


def test_a_redelivery_after_a_broken_connection_is_allowed_and_within_one_is_not() -> None:
    again = Delivery("q-2", 2, False, redelivered=True)
    broken = [Delivery("q-1", 1, True), Delivery("q-2", 1, True), again]
    assert check([enq(d_deliveries=broken)]) == []
    twice = [Delivery("q-1", 1, False), Delivery("q-2", 1, False), Delivery("q-2", 1, False)]
    assert check([enq(d_deliveries=twice)])[0].startswith("q at D: q-2 delivered twice")


def test_a_message_seen_after_its_consumer_closed_may_come_again_marked_redelivered() -> None:
    # tests/chaos seed 2024: transfers that crossed the consumer's close.
    unaccepted = Delivery("q-2", 1, False, accepted=False)
    again = Delivery("q-2", 2, False, redelivered=True)
    assert check([enq(d_deliveries=[Delivery("q-1", 1, False), unaccepted, again])]) == []
    unmarked = Delivery("q-2", 2, False)
    problems = check([enq(d_deliveries=[Delivery("q-1", 1, False), unaccepted, unmarked])])
    assert problems == [
        "q at D: q-2 delivered again (connection 2) without the redelivered mark after "
        "connection 1 left it unsettled"
    ]
    # Accepted, then seen again: twice, whatever the mark says.
    accepted = Delivery("q-2", 1, False)
    problems = check([enq(d_deliveries=[Delivery("q-1", 1, False), accepted, again])])
    assert problems[0].startswith("q at D: q-2 delivered twice")


def test_out_of_order_and_never_accepted_are_named() -> None:
    assert check([enq(d_final=["q-4", "q-3"])]) == ["q at D: q-3 after q-4: out of order"]
    problems = check([enq(d_final=["q-3", "q-4", "q-6"])])
    assert problems == ["q at D: q-6 is at D but P never accepted it"]


def test_a_full_replica_must_equal_p_message_by_message() -> None:
    record = QueueRecord("f", "full", published={"f-1": ACCEPTED, "f-2": ACCEPTED})
    record.p_final = ["f-1", "f-2"]
    record.d_final = ["f-1", "f-2"]
    record.p_digest = record.d_digest = "abc"
    assert check([record]) == []
    record.d_final = ["f-2"]
    assert check([record]) == ["f (full): position 0: P holds f-1, D holds f-2"]
    record.d_final = ["f-1"]
    assert check([record]) == ["f (full): only P holds f-2 (position 1)"]


def test_wiring_is_empty_at_d_and_none_is_absent() -> None:
    wiring = QueueRecord("w", "wiring", published={"w-1": ACCEPTED}, p_final=["w-1"])
    wiring.d_final = []
    none = QueueRecord("n", "none", published={"n-1": ACCEPTED}, p_final=["n-1"])
    assert check([wiring, none]) == []
    wiring.d_final, none.d_final = ["w-1"], []
    assert check([wiring, none]) == [
        "w (wiring) holds w-1 … at D: it should be empty",
        "n (none) exists at D with 0 messages",
    ]


def test_a_read_only_full_replica_is_checked_by_digest_and_depth() -> None:
    record = QueueRecord("f", "full", published={"f-1": ACCEPTED, "f-2": ACCEPTED})
    record.p_final, record.d_final, record.d_readable, record.d_depth = ["f-1", "f-2"], [], False, 2
    record.p_digest = record.d_digest = "abc"
    assert check([record]) == []
    record.d_digest = "abd"
    assert check([record]) == [
        "f (full): D holds 2 messages (digest abd), P 2 (digest abc), from ['f-1'] on"
    ]


def test_a_message_that_came_back_to_the_queue_may_arrive_after_later_ones() -> None:
    # Seed 2025 on corosync: q-switch-2750 after q-switch-2767 at P.  A
    # transfer on the wire when its broker died reached no client; the
    # message went back to the queue, marked redelivered, while another
    # consumer took the later ones.
    back = Delivery("q-1", 2, False, redelivered=True)
    assert check([enq(d_deliveries=[Delivery("q-2", 1, False), back])]) == []
    unmarked = Delivery("q-1", 2, False)
    problems = check([enq(d_deliveries=[Delivery("q-2", 1, False), unmarked])])
    assert problems == ["q at D: q-1 after q-2: out of order"]
