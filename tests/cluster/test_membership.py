"""Who holds the state, who donates it, and when (cluster/membership), as tables of views."""

from __future__ import annotations

from cluster.bus.contract import MemberId, ViewChange
from cluster.membership import (
    Membership,
    Rejoin,
    SendSnapshot,
    SnapshotAssembly,
    StartGenesis,
)
from protocol.cluster import StateChunk

A, B, C = MemberId(1, 10), MemberId(2, 20), MemberId(3, 30)


def view(n: int, members: tuple[MemberId, ...], joined=(), left=(), quorate=True) -> ViewChange:
    return ViewChange(n, tuple(sorted(members)), tuple(joined), tuple(left), quorate)


def test_a_view_of_new_members_is_a_genesis_announced_by_the_lowest() -> None:
    a, b = Membership(A), Membership(B)
    v = view(1, (A, B), joined=(A, B))
    assert a.on_view(v) == [StartGenesis(announce=True)]
    assert b.on_view(v) == [StartGenesis(announce=False)]
    assert a.is_ready and b.is_ready


def test_the_lowest_ready_member_donates_to_a_joiner_cut_at_its_join() -> None:
    a = Membership(A)
    a.on_view(view(1, (A,), joined=(A,)))
    a.on_delivery()
    assert a.on_view(view(2, (A, B), joined=(B,))) == [SendSnapshot(B, 0)]
    b = Membership(B)
    assert b.on_view(view(2, (A, B), joined=(B,))) == []
    assert not b.is_ready


def test_a_new_donor_takes_over_when_the_old_one_leaves_mid_transfer() -> None:
    a, c = Membership(A), Membership(C)
    for m in (a, c):
        m.on_view(view(1, (A, C), joined=(A, C)))
    for m in (a, c):
        m.on_view(view(2, (A, B, C), joined=(B,)))
        m.on_delivery()
        m.on_delivery()
    # A dies before B is ready: C donates, cut after the 3 events B saw.
    assert c.on_view(view(3, (B, C), left=(A,))) == [SendSnapshot(B, 3)]


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
    assert a.on_view(merge) == [SendSnapshot(C, 0)]
    assert c.on_view(view(3, (A, B, C), joined=(A, B), quorate=False)) == [Rejoin()]
    assert not c.is_ready


def test_members_that_were_never_ready_do_not_make_a_lone_member_rejoin() -> None:
    a = Membership(A)
    a.on_view(view(1, (A,), joined=(A,), quorate=False))
    assert a.on_view(view(2, (A, B), joined=(B,))) == [SendSnapshot(B, 0)]


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
