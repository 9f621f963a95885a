"""Who holds the state, who donates it, and when (cluster/membership), as tables of views."""

from __future__ import annotations

from cluster.bus.contract import MemberId, ViewChange
from cluster.membership import (
    AnnounceHave,
    Membership,
    Rejoin,
    SendSnapshot,
    SnapshotAssembly,
    StartGenesis,
)
from protocol.cluster import JoinHave, StateChunk, pack_have_ranges

A, B, C = MemberId(1, 10), MemberId(2, 20), MemberId(3, 30)


def have(m: MemberId, **ranges: tuple[int, int]) -> JoinHave:
    return JoinHave(
        m.node, m.pid, 7 if ranges else 0, 900 if ranges else 0, pack_have_ranges(ranges)
    )


def view(n: int, members: tuple[MemberId, ...], joined=(), left=(), quorate=True) -> ViewChange:
    return ViewChange(n, tuple(sorted(members)), tuple(joined), tuple(left), quorate)


def test_a_view_of_new_members_is_a_genesis_announced_by_the_lowest() -> None:
    a, b = Membership(A), Membership(B)
    v = view(1, (A, B), joined=(A, B))
    assert a.on_view(v) == [StartGenesis(announce=True)]
    assert b.on_view(v) == [StartGenesis(announce=False)]
    assert a.is_ready and b.is_ready


def test_the_lowest_ready_member_donates_when_it_applies_the_joiners_join_have() -> None:
    a = Membership(A)
    a.on_view(view(1, (A,), joined=(A,)))
    a.on_delivery()
    # No donation at the view change: the donor waits for what B has.
    assert a.on_view(view(2, (A, B), joined=(B,))) == []
    a.on_delivery()
    a.on_delivery()  # the frame with B's JoinHave: the cut is after it
    h = have(B, orders=(1, 10_000))
    assert a.on_join_have(B, h) == [SendSnapshot(B, 2, h)]
    b = Membership(B)
    assert b.on_view(view(2, (A, B), joined=(B,))) == [AnnounceHave()]
    assert not b.is_ready


def test_a_join_have_of_a_ready_member_or_a_stranger_donates_nothing() -> None:
    a = Membership(A)
    a.on_view(view(1, (A, C), joined=(A, C)))
    assert a.on_join_have(C, have(C)) == []
    assert a.on_join_have(B, have(B)) == []


def test_only_the_donor_donates_and_a_second_join_have_is_served_again() -> None:
    a, c = Membership(A), Membership(C)
    for m in (a, c):
        m.on_view(view(1, (A, C), joined=(A, C)))
        m.on_view(view(2, (A, B, C), joined=(B,)))
        m.on_delivery()
    first = have(B, orders=(1, 5))
    assert a.on_join_have(B, first) == [SendSnapshot(B, 1, first)]
    assert c.on_join_have(B, first) == []
    # B's journal could not fill the delta: it asks again with nothing.
    for m in (a, c):
        m.on_delivery()
    assert a.on_join_have(B, have(B)) == [SendSnapshot(B, 2, have(B))]
    assert c.on_join_have(B, have(B)) == []


def test_a_new_donor_takes_over_with_the_join_have_it_saw() -> None:
    a, c = Membership(A), Membership(C)
    for m in (a, c):
        m.on_view(view(1, (A, C), joined=(A, C)))
    h = have(B, orders=(3, 4))
    for m in (a, c):
        m.on_view(view(2, (A, B, C), joined=(B,)))
        m.on_delivery()
        m.on_join_have(B, h)
        m.on_delivery()
    # A dies before B is ready: C donates with B's JoinHave, cut after the 3
    # events B saw.
    assert c.on_view(view(3, (B, C), left=(A,))) == [SendSnapshot(B, 3, h)]


def test_a_takeover_before_the_join_have_waits_for_it() -> None:
    c = Membership(C)
    c.on_view(view(1, (A, C), joined=(A, C)))
    c.on_view(view(2, (A, B, C), joined=(B,)))
    assert c.on_view(view(3, (B, C), left=(A,))) == []
    c.on_delivery()
    assert c.on_join_have(B, have(B)) == [SendSnapshot(B, 2, have(B))]


def test_a_joiner_that_left_before_its_join_have_is_forgotten() -> None:
    a = Membership(A)
    a.on_view(view(1, (A,), joined=(A,)))
    a.on_view(view(2, (A, B), joined=(B,)))
    a.on_view(view(3, (A,), left=(B,)))
    assert a.on_join_have(B, have(B)) == []
    assert (a.haves, a.served) == ({}, set())


def test_a_member_that_joins_while_the_donor_buffers_is_served_at_its_genesis() -> None:
    # B and C joined after A; A leaves before either is ready: B starts a new
    # site and, having noted C's JoinHave while buffering, serves C.
    b = Membership(B)
    b.on_view(view(2, (A, B), joined=(B,)))
    b.on_view(view(3, (A, B, C), joined=(C,)))
    b.on_delivery()
    assert b.on_join_have(C, have(C)) == []
    assert b.on_view(view(4, (B, C), left=(A,))) == [
        StartGenesis(announce=True),
        SendSnapshot(C, 2, have(C)),
    ]


def test_a_joiner_whose_elders_all_left_starts_a_new_site() -> None:
    b = Membership(B)
    b.on_view(view(2, (A, B), joined=(B,)))
    assert b.on_view(view(3, (B,), left=(A,))) == [StartGenesis(announce=True)]


def test_the_minority_side_of_a_healed_partition_rejoins_and_the_majority_donates() -> None:
    a, c = Membership(A), Membership(C)
    for m in (a, c):
        m.on_view(view(1, (A, B, C), joined=(A, B, C)))
    a.on_view(view(2, (A, B), left=(C,), quorate=True))
    c.on_view(view(2, (C,), left=(A, B), quorate=False))
    merge = view(3, (A, B, C), joined=(C,))
    assert a.on_view(merge) == []
    assert c.on_view(view(3, (A, B, C), joined=(A, B), quorate=False)) == [Rejoin()]
    assert not c.is_ready
    a.on_delivery()
    assert a.on_join_have(C, have(C)) == [SendSnapshot(C, 1, have(C))]


def test_members_that_were_never_ready_do_not_make_a_lone_member_rejoin() -> None:
    a = Membership(A)
    a.on_view(view(1, (A,), joined=(A,), quorate=False))
    assert a.on_view(view(2, (A, B), joined=(B,))) == []
    a.on_delivery()
    assert a.on_join_have(B, have(B)) == [SendSnapshot(B, 1, have(B))]


def chunk(target: MemberId, transfer: int, index: int, final: bool, data: bytes) -> StateChunk:
    return StateChunk(target.node, target.pid, transfer, index, final, data)


def test_a_snapshot_is_the_final_chunk_of_the_transfer_an_index_0_started() -> None:
    assembly = SnapshotAssembly(B)
    assert assembly.on_chunk(A, chunk(B, 1, 0, False, b"ab")) is None
    assert assembly.on_chunk(A, chunk(C, 1, 1, True, b"not mine")) is None
    assert assembly.on_chunk(A, chunk(B, 1, 1, True, b"cd")) == b"abcd"
    # A later chunk without its index 0 starts nothing.
    assert assembly.on_chunk(A, chunk(B, 2, 1, True, b"ef")) is None


def test_transfers_of_two_donors_with_the_same_number_do_not_mix() -> None:
    # node 1 pid 65,538 and node 2 pid 1 made the same key when the key was
    # transfer * 1_000_003 + node * 65_537 + pid.
    first, second = MemberId(1, 65_538), MemberId(2, 1)
    assembly = SnapshotAssembly(B)
    assert assembly.on_chunk(first, chunk(B, 7, 0, False, b"first-0|")) is None
    assert assembly.on_chunk(second, chunk(B, 7, 1, True, b"second-1")) is None
    assert assembly.on_chunk(first, chunk(B, 7, 1, True, b"first-1")) == b"first-0|first-1"


def test_a_new_donor_restarts_the_transfer_and_a_reset_forgets_it() -> None:
    assembly = SnapshotAssembly(B)
    assembly.on_chunk(A, chunk(B, 1, 0, False, b"old"))
    assembly.on_chunk(C, chunk(B, 1, 0, False, b"new"))
    assert assembly.on_chunk(A, chunk(B, 1, 1, True, b"old")) is None
    assembly.reset()
    assert assembly.on_chunk(C, chunk(B, 1, 1, True, b"new")) is None


def isolate_then_merge(*ms: Membership) -> None:
    """Every member starts the site, then finds itself alone in a view
    without quorum (a partition that left no side quorate), then the site
    merges again: each member rejoins, as the members returning were ready."""
    everyone = tuple(m.me for m in ms)
    for m in ms:
        m.on_view(view(1, everyone, joined=everyone))
    for m in ms:
        others = tuple(x for x in everyone if x != m.me)
        m.on_view(view(2, (m.me,), left=others, quorate=False))
        assert m.on_view(view(3, everyone, joined=others)) == [Rejoin()]


def announce(ms: tuple[Membership, ...], sender: MemberId) -> list[list]:
    """``sender``'s JoinHave delivered to every member; what each must do."""
    out = []
    for m in ms:
        m.on_delivery()
        out.append(m.on_join_have(sender, have(sender)))
    return out


def test_a_partition_that_left_no_side_quorate_starts_the_site_over_when_all_announced() -> None:
    # Found by the chaos run (seed 2025): every D node alone at once, then the
    # merge made every member drop its state and wait for a donor that no
    # longer existed; a broker restarted later never became ready.
    ms = (Membership(A), Membership(B), Membership(C))
    isolate_then_merge(*ms)
    assert announce(ms, A) == [[], [], []]
    assert announce(ms, B) == [[], [], []]
    assert announce(ms, C) == [
        [StartGenesis(announce=True, start_over=True)],
        [StartGenesis(announce=False, start_over=True)],
        [StartGenesis(announce=False, start_over=True)],
    ]
    for m in ms:
        assert m.is_ready and m.ready == {A, B, C} and m.donor() == A


def test_members_waiting_for_a_donor_announce_again_at_each_view_change() -> None:
    # A and B merge first (both rejoin), then C: B's and C's JoinHave come
    # after the second view, so each waiting member says again what it has.
    a, b, c = Membership(A), Membership(B), Membership(C)
    for m in (a, b, c):
        m.on_view(view(1, (A, B, C), joined=(A, B, C)))
        m.on_view(view(2, (m.me,), left=tuple({A, B, C} - {m.me}), quorate=False))
    assert a.on_view(view(3, (A, B), joined=(B,))) == [Rejoin()]
    assert b.on_view(view(3, (A, B), joined=(A,))) == [Rejoin()]
    assert announce((a, b), A) == [[], []]
    assert a.on_view(view(4, (A, B, C), joined=(C,))) == [AnnounceHave(again=True)]
    assert b.on_view(view(4, (A, B, C), joined=(C,))) == [AnnounceHave(again=True)]
    assert c.on_view(view(4, (A, B, C), joined=(A, B))) == [Rejoin()]
    assert announce((a, b, c), B) == [[], [], []]
    assert announce((a, b, c), C) == [[], [], []]  # A's came before the view
    assert announce((a, b, c), A)[0] == [StartGenesis(announce=True, start_over=True)]


def test_no_start_over_while_a_member_became_ready_or_without_quorum() -> None:
    ms = (Membership(A), Membership(B), Membership(C))
    isolate_then_merge(*ms)
    announce(ms, A)
    for m in ms:
        m.on_member_ready(B)  # B got a snapshot after all: it holds the state
    announce(ms, B)
    assert announce(ms, C) == [[], [], []]
    lone = Membership(A)
    lone.on_view(view(1, (A, B), joined=(A, B)))
    lone.on_view(view(2, (A,), left=(B,), quorate=False))
    lone.on_view(view(3, (A, B), joined=(B,), quorate=False))
    lone.on_delivery()
    assert lone.on_join_have(A, have(A)) == []


def test_a_donor_does_not_serve_again_a_join_have_said_again() -> None:
    a = Membership(A)
    a.on_view(view(1, (A,), joined=(A,)))
    a.on_view(view(2, (A, B), joined=(B,)))
    a.on_delivery()
    assert a.on_join_have(B, have(B)) == [SendSnapshot(B, 1, have(B))]
    a.on_view(view(3, (A, B, C), joined=(C,)))
    a.on_delivery()
    assert a.on_join_have(B, have(B)) == []  # the same, said at the view change
    a.on_delivery()
    assert a.on_join_have(C, have(C)) == [SendSnapshot(C, 2, have(C))]
    # A different one (its delta could not be filled) asks again.
    a.on_delivery()
    assert a.on_join_have(B, have(B, q=(1, 2))) == [SendSnapshot(B, 5, have(B, q=(1, 2)))]


def test_a_member_that_restored_meanwhile_starts_over_with_the_others() -> None:
    # C's snapshot came from a donor that left before the view: C holds the
    # state, but its MemberReady was not delivered yet, so for the stream
    # nobody in the view does; replayed MemberReadys of older views say
    # nothing of this one.  Every member decides alike, C too.
    ms = (Membership(A), Membership(B), Membership(C))
    isolate_then_merge(*ms)
    c = ms[2]
    c.on_restored({A}, c.members)
    c.on_member_ready(A, live=False)
    assert announce(ms, A) == [[], [], []]
    assert announce(ms, B) == [[], [], []]
    assert [actions[0].start_over for actions in announce(ms, C)] == [True, True, True]


def test_a_rejoiner_whose_elders_all_left_sets_its_stale_state_aside() -> None:
    # Chaos seed 2025: D's node 2 rejoined at a merge, then the members it
    # waited for left again; it started a site with its cohort on top of its
    # stale state (its journal then broke its order).  Its state goes aside
    # as a recovery candidate, as in a start-over.
    ms = (Membership(A), Membership(B), Membership(C))
    isolate_then_merge(*ms)
    b = ms[1]
    assert b.on_view(view(4, (B,), left=(A, C), quorate=False)) == [
        StartGenesis(announce=True, start_over=True)
    ]
    # A joiner that never held the state starts plainly.
    fresh = Membership(B)
    fresh.on_view(view(2, (A, B), joined=(B,)))
    assert fresh.on_view(view(3, (B,), left=(A,))) == [StartGenesis(announce=True)]
