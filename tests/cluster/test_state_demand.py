"""cluster.state.demand: what an Acquire did not get goes to its consumer as
it arrives, in the command that brought it, on every member alike."""

from __future__ import annotations

import pytest

from cluster.state import (
    Delivered,
    Refused,
    Released,
    SiteState,
    apply,
    members_left,
    restore_untrusted,
    session_holdings,
    session_owner,
    snapshot,
)
from cluster.state.persistence import take_recovery
from protocol import cluster as pc
from protocol.errors import RemoteProtocolError
from tests.cluster.test_state import SA, SB, B, publish, site


def delivered(eff: list[object]) -> list[tuple[int, int, int]]:
    """(session, consumer, pos) of each Delivered effect."""
    return [(e.session, e.consumer, e.message.pos) for e in eff if isinstance(e, Delivered)]


def publish_one(st: SiteState, queue: str, body: bytes) -> list[object]:
    return list(apply(st, pc.Publish("", queue, body, ref=st.cseq + 1)))


def test_an_acquire_on_an_empty_queue_stands_and_the_next_publish_is_delivered_by_it() -> None:
    st = site("q")
    assert apply(st, pc.Acquire("q", SA, 7, 2)) == []
    # The publish itself hands the message out: no second acquire on the bus.
    assert delivered(publish_one(st, "q", b"1")) == [(SA, 7, 1)]
    assert delivered(publish_one(st, "q", b"2")) == [(SA, 7, 2)]
    # Its credit is spent: the third stays in the queue.
    assert delivered(publish_one(st, "q", b"3")) == []
    assert session_holdings(st, SA) == {"q": (1, 2)}
    assert st.demand == {} and st.queues["q"].waiting == {}


def test_what_the_queue_holds_goes_first_and_only_the_rest_stands() -> None:
    st = site("q")
    publish(st, "q", b"1")
    assert delivered(apply(st, pc.Acquire("q", SA, 7, 3))) == [(SA, 7, 1)]
    assert st.queues["q"].waiting == {(SA, 7): 2}
    assert delivered(apply(st, pc.Acquire("q", SA, 7, 1))) == []  # more credit: adds up
    assert st.queues["q"].waiting == {(SA, 7): 3}


def test_waiting_consumers_take_turns() -> None:
    st = site("q")
    apply(st, pc.Acquire("q", SA, 1, 2))
    apply(st, pc.Acquire("q", SB, 2, 2))
    got = [delivered(publish_one(st, "q", bytes([n])))[0][:2] for n in range(4)]
    assert got == [(SA, 1), (SB, 2), (SA, 1), (SB, 2)]
    assert delivered(publish_one(st, "q", b"5")) == []


def test_a_withdrawn_demand_takes_nothing_more() -> None:
    st = site("q")
    apply(st, pc.Acquire("q", SA, 7, 5))
    apply(st, pc.Withdraw("q", SA, 7))
    assert delivered(publish_one(st, "q", b"1")) == []
    assert st.demand == {}
    apply(st, pc.Withdraw("q", SA, 7))  # again, or for a queue that is gone: nothing
    apply(st, pc.Withdraw("gone", SA, 7))


def test_a_closing_session_ends_its_demand_and_its_messages_go_to_the_others() -> None:
    st = site("q")
    publish(st, "q", b"1")
    apply(st, pc.Acquire("q", SA, 1, 2))  # takes 1, waits for one more
    apply(st, pc.Acquire("q", SB, 2, 1))  # waits
    eff = apply(st, pc.SessionClose(SA))
    assert [e.reason for e in eff if isinstance(e, Released)] == ["session_close"]
    assert delivered(eff) == [(SB, 2, 1)]
    assert st.queues["q"].waiting == {}
    assert delivered(publish_one(st, "q", b"2")) == []


def test_a_member_leaving_hands_its_messages_to_the_waiting_consumers() -> None:
    st = site("q")
    publish(st, "q", b"1")
    apply(st, pc.Acquire("q", SB, 2, 1))  # member B's consumer holds it
    apply(st, pc.Acquire("q", SA, 1, 1))  # member A's waits
    eff = members_left(st, [B])
    assert delivered(eff) == [(SA, 1, 1)]
    assert st.demand == {}


def test_a_deleted_queue_takes_its_waiting_consumers_with_it() -> None:
    st = site("q")
    apply(st, pc.Acquire("q", SA, 1, 3))
    apply(st, pc.QueueDelete("q"))
    assert st.demand == {}
    apply(st, pc.QueueDeclare("q"))
    assert delivered(publish_one(st, "q", b"1")) == []


def test_a_whole_site_restart_ends_every_demand_even_on_a_queue_it_drops() -> None:
    st = site("transient")  # not durable: the restart drops the queue itself
    apply(st, pc.QueueDeclare("kept", {"durable": True}))
    apply(st, pc.Acquire("transient", SA, 1, 3))
    apply(st, pc.Acquire("kept", SB, 2, 3))
    dropped = take_recovery(st)
    assert dropped.queues == ("transient",)
    assert st.demand == {} and st.queues["kept"].waiting == {}


def test_a_message_refused_as_undeliverable_here_passes_to_the_next_consumer() -> None:
    st = site("q")
    publish(st, "q", b"1")
    apply(st, pc.Acquire("q", SA, 1, 1))
    apply(st, pc.Modify("q", SA, 1, (1,), False, True, b""))  # not for consumer 1 of SA
    assert apply(st, pc.Acquire("q", SA, 1, 1)) == []
    assert delivered(apply(st, pc.Acquire("q", SB, 2, 1))) == [(SB, 2, 1)]
    # Consumer 1 still waits, and the next message is its.
    assert delivered(publish_one(st, "q", b"2")) == [(SA, 1, 2)]


def test_a_quiesced_queue_refuses_its_waiting_consumers_instead_of_serving_them() -> None:
    st = site("q")
    publish(st, "q", b"1")
    apply(st, pc.Acquire("q", SB, 2, 1))  # held
    apply(st, pc.Acquire("q", SA, 1, 1))  # waits
    apply(st, pc.Switchover("site-d", pc.SwitchoverPhase.QUIESCE, 1, {"q": None}))
    eff = apply(st, pc.Release("q", SB, (1,)))
    refused = [e for e in eff if isinstance(e, Refused)]
    assert [(r.session, r.name) for r in refused] == [(SA, "q")]
    # Addressed to the member that owns the session: its broker closes the link.
    assert (refused[0].sender.node, refused[0].sender.pid) == session_owner(SA)
    assert "switchover" in refused[0].description
    assert delivered(eff) == [] and st.demand == {}


def test_standing_demand_survives_a_snapshot_so_every_member_assigns_alike() -> None:
    st = site("q", "r")
    apply(st, pc.Acquire("q", SA, 1, 2))
    apply(st, pc.Acquire("q", SB, 2, 1))
    apply(st, pc.Acquire("r", SB, 3, 4))
    copy = restore_untrusted(snapshot(st))
    assert snapshot(copy) == snapshot(st)
    assert copy.demand == {"q": None, "r": None}
    for body in (b"1", b"2", b"3"):
        assert delivered(publish_one(copy, "q", body)) == delivered(publish_one(st, "q", body))


@pytest.mark.parametrize(
    ("patch", "words"),
    [
        (lambda blob: blob.replace(b"\x00\x00\x00\x04", b"\x00\x00\x00\x00"), "waits for 0"),
        (lambda blob: blob.replace(b"\x01q", b"\x01x"), "waits for"),
    ],
)
def test_a_snapshot_whose_demand_names_nothing_it_holds_is_refused(
    patch: object, words: str
) -> None:
    st = site("q")
    apply(st, pc.Acquire("q", SA, 1, 4))
    blob = snapshot(st)
    tail = blob[-19:]  # the demand: one entry (name, session, consumer, count)
    bad = blob[:-19] + patch(tail)  # type: ignore[operator]
    assert bad != blob
    with pytest.raises(RemoteProtocolError, match=words):
        restore_untrusted(bad)
