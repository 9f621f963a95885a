"""cluster.state.resync: a resync staged in pieces and installed at one point.

The pieces are what D's ingress multicasts for each link chunk; the commit is
what it multicasts at RESYNC_END.  D's clients must never see part of a
resync, a piece that does not follow must never be installed as if the
snapshot were whole, and a member that joins between two pieces must install
exactly what the others install."""

from __future__ import annotations

from cluster import state as st
from protocol import cluster as pc
from tests.support.state import genesis_state, p_with_messages, resync_chunks

CHUNK = 2048  # bytes per piece: many pieces for a few hundred messages


def _pieces(p: st.SiteState, *, epoch: int = 1) -> list[pc.ResyncStage]:
    return [
        pc.ResyncStage("site-p", p.incarnation, p.cseq, epoch, i, chunk)
        for i, chunk in enumerate(resync_chunks(p, epoch=epoch, chunk_bytes=CHUNK))
    ]


def _commit(p: st.SiteState, pieces: int, *, epoch: int = 1) -> pc.ResyncCommit:
    return pc.ResyncCommit("site-p", p.incarnation, p.cseq, epoch, 123, pieces)


def _whole(p: st.SiteState) -> pc.ResyncApply:
    snapshot = b"".join(resync_chunks(p))
    return pc.ResyncApply("site-p", p.incarnation, p.cseq, 1, 123, snapshot)


def test_pieces_are_invisible_until_the_commit_installs_them_as_one_resync() -> None:
    p = p_with_messages(200)
    d = genesis_state("site-d", 9)
    pieces = _pieces(p)
    assert len(pieces) > 5
    queues_before = st.digest(genesis_state("site-d", 9))
    for piece in pieces:
        st.apply(d, piece)
        assert not d.queues and d.origins["site-p"].applied.get(7, 0) == 0
    assert st.digest(d) != queues_before  # staged: part of the state, not of the queues
    effects = st.apply(d, _commit(p, len(pieces)))
    assert any(getattr(e, "outcome", None) == st.Outcome.APPLIED for e in effects)
    whole = genesis_state("site-d", 9)
    st.apply(whole, _whole(p))
    for queue in ("q-full", "q-enq", "q-wire"):
        assert st.queue_digest(d, queue) == st.queue_digest(whole, queue)
    assert st.queue_digest(d, "q-full") == st.queue_digest(p, "q-full")
    assert d.exchanges["ex"].bindings == {("q-wire", ""): {}}
    assert d.origins["site-p"].applied[7] == p.cseq
    assert not d.staged
    assert d.counters["resync_pieces_staged"] == len(pieces)


def test_a_missing_piece_or_a_wrong_count_installs_nothing() -> None:
    p = p_with_messages(100)
    pieces = _pieces(p)
    # Piece 2 never reached D's bus: 3 does not follow 1, the staging is gone.
    d = genesis_state("site-d", 9)
    for piece in pieces[:2] + pieces[3:]:
        st.apply(d, piece)
    st.apply(d, _commit(p, len(pieces)))
    assert not d.queues and d.origins["site-p"].applied.get(7, 0) == 0
    assert d.counters["resync_pieces_refused"] == len(pieces) - 3  # 3 and every one after
    assert d.counters["resync_commits_refused"] == 1
    # Every piece staged, but the commit names another count (or cut).
    for commit in (_commit(p, len(pieces) + 1), _commit(p, len(pieces) - 1)):
        d = genesis_state("site-d", 9)
        for piece in pieces:
            st.apply(d, piece)
        st.apply(d, commit)
        assert not d.queues and d.counters["resync_commits_refused"] == 1


def test_piece_zero_starts_again_after_a_broken_resync() -> None:
    p = p_with_messages(100)
    d = genesis_state("site-d", 9)
    first = _pieces(p)
    for piece in first[:3]:  # the link broke after three pieces
        st.apply(d, piece)
    st.apply(p, pc.Publish("", "q-full", b"late", "late"))
    second = _pieces(p)  # the next connection: a new cut, from piece 0
    for piece in second:
        st.apply(d, piece)
    st.apply(d, _commit(p, len(second)))
    assert st.queue_digest(d, "q-full") == st.queue_digest(p, "q-full")
    assert d.queues["q-full"].depth == 101


def test_a_member_that_joins_between_pieces_installs_the_same_state() -> None:
    p = p_with_messages(150)
    d = genesis_state("site-d", 9)
    pieces = _pieces(p)
    half = len(pieces) // 2
    for piece in pieces[:half]:
        st.apply(d, piece)
    joined = st.restore_untrusted(st.snapshot(d))  # the state transfer to a new member
    assert st.digest(joined) == st.digest(d)
    for member in (d, joined):
        for piece in pieces[half:]:
            st.apply(member, piece)
        st.apply(member, _commit(p, len(pieces)))
    assert st.digest(joined) == st.digest(d)
    assert st.queue_digest(joined, "q-full") == st.queue_digest(p, "q-full")


def test_pieces_of_a_fenced_epoch_are_not_staged() -> None:
    p = p_with_messages(20)
    d = genesis_state("site-d", 9)
    st.apply(d, _whole(p))
    st.apply(d, pc.Promote("site-p", 2, 0))
    st.apply(p, pc.Publish("", "q-full", b"late", "late"))
    pieces = _pieces(p, epoch=2)  # the epoch D was promoted at: the old primary's
    for piece in pieces:
        st.apply(d, piece)
    st.apply(d, _commit(p, len(pieces), epoch=2))
    assert not d.staged
    assert d.queues["q-full"].depth == 20
    assert d.counters["r7_fenced"] == len(pieces) + 1


def test_a_damaged_piece_drops_the_staging() -> None:
    p = p_with_messages(50)
    d = genesis_state("site-d", 9)
    pieces = _pieces(p)
    st.apply(d, pieces[0])
    st.apply(d, pc.ResyncStage("site-p", 7, p.cseq, 1, 1, b"\x00\x00\x00\x09abc"))
    assert not d.staged and d.counters["ignored"] == 1
    for piece in pieces[2:]:
        st.apply(d, piece)
    st.apply(d, _commit(p, len(pieces)))
    assert not d.queues


def test_an_empty_snapshot_commits_with_no_pieces() -> None:
    # A primary with nothing replicated yet: the egress sends no chunk at all.
    p = genesis_state("site-p", 7)
    d = genesis_state("site-d", 9)
    effects = st.apply(d, _commit(p, 0))
    assert any(getattr(e, "outcome", None) == st.Outcome.APPLIED for e in effects)
    assert d.origins["site-p"].applied[7] == p.cseq
    assert d.counters["resync_commits_refused"] == 0
