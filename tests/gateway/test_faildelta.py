"""A failback by delta (docs/operations.md, "Failback by delta"): after a
forced failover, the old primary rejoins as the promoted site's DR site,
announces what it holds, and the promoted site's resync leaves that out.
Both sites' states and taps as in tests/gateway/test_swap.py, the resync
made by the egress's own snapshot stream and staged as D's bus would."""

from __future__ import annotations

from cluster.state import Refused, apply
from cluster.state.digests import content_digest
from cluster.state.model import Replica
from cluster.state.views import applied
from gateway import resync as rs
from gateway.roles import runs_as_primary
from protocol import cluster as pc
from protocol.holdings import pack_holdings, unpack_holdings_untrusted
from protocol.modes import Mode
from tests.gateway.test_swap import Pair, Site, T, loaded, verified
from tests.gateway.test_tap import SA, A

BODY = b"x" * 500  # most of the state: what a delta does not ship again


def failed_over() -> Pair:
    """P replicated 40 messages of ``f.q`` to D, then the WAN was cut: P took
    50 more (stranded) and its consumer took one D has; D was promoted, took
    its own publishes and its consumer took one of P's."""
    pair = loaded()
    for i in range(3, 40):
        pair.run(pc.Publish("", "f.q", BODY, f"p-f.q-{i}"))
    # The WAN is cut: P's commands no longer reach D.
    for i in range(1, 51):
        pair.p.run(pc.Publish("", "f.q" if i % 2 else "e.q", BODY, f"s-{i}"))
    pair.p.run(pc.Accept("f.q", SA, (pair.p.positions("f.q")[0],)))
    apply(pair.d.state, pc.Promote("site-p", 2, T))
    pair.d.run(pc.SessionOpen(SA))
    for i in range(3):
        pair.d.run(pc.Publish("", "f.q", BODY, f"d-f.q-{i}"))
        pair.d.run(pc.Publish("", "e.q", BODY, f"d-e.q-{i}"))
    pair.d.run(pc.Acquire("f.q", SA, 9, 1))  # D's consumer takes P's third message
    pair.d.run(pc.Accept("f.q", SA, (pair.d.positions("f.q")[2],)))
    return pair


def adopt_and_rejoin(pair: Pair) -> None:
    pair.d.run(pc.Switchover("site-p", pc.SwitchoverPhase.ADOPT, T, {"swapped": 1}))
    guarded = {"f.q": None, "e.q": None}
    pair.p.run(pc.Switchover("site-d", pc.SwitchoverPhase.REJOIN, T, guarded))


def resync(frm: Site, to: Site, *, delta: bool = True) -> rs.SnapshotStream:
    """``frm``'s resync of ``to`` as the egress makes it, with ``to``'s
    holdings as its WELCOME carries them, staged and committed at ``to``."""
    frm.tap.resync_rules(frm.state)
    plan = rs.plan_snapshot(frm.state, frm.tap.rules)
    welcome = rs.welcome_holdings(to.state, frm.name, 0) if delta else b""
    stream = rs.SnapshotStream(
        plan,
        frm.tap.rules,
        origin=frm.name,
        epoch=frm.state.epoch,
        time_us=T,
        holdings=rs.delta_holdings(welcome, 0),
        peer=to.name,
    )
    chunks = list(stream.chunks())
    inc = frm.state.incarnation
    for i, chunk in enumerate(chunks):
        apply(to.state, pc.ResyncStage(frm.name, inc, plan.cut, frm.state.epoch, i, chunk))
    apply(to.state, pc.ResyncCommit(frm.name, inc, plan.cut, frm.state.epoch, T, len(chunks)))
    return stream


def test_the_old_primary_ends_equal_to_the_promoted_site_with_only_the_rest_shipped() -> None:
    pair = failed_over()
    assert pair.p.ids("f.q") != pair.d.ids("f.q")
    adopt_and_rejoin(pair)
    assert runs_as_primary(pair.d.state, configured=False, reversible=True)
    assert not runs_as_primary(pair.p.state, configured=True, reversible=True)
    # Frozen until the resync: nothing P announced may go meanwhile.
    refused = apply(pair.p.state, pc.Acquire("e.q", SA, 1, 1), sender=A)
    assert len(refused) == 1 and isinstance(refused[0], Refused)

    stream = resync(pair.d, pair.p)

    p, d = pair.p.state, pair.d.state
    assert p.rejoining == "" and applied(p, "site-d", d.incarnation) == d.cseq
    # full: exactly D's messages, in D's positions; P's stranded ones are gone
    assert pair.p.ids("f.q") == pair.d.ids("f.q")
    assert pair.p.positions("f.q") == pair.d.positions("f.q")
    assert content_digest(p.queues["f.q"]) == content_digest(d.queues["f.q"])
    assert not any(i.startswith("s-") for i in pair.p.ids("f.q"))
    replica = p.queues["f.q"].replica
    assert replica is not None and (replica.origin, replica.mode) == ("site-d", Mode.FULL)
    # Kept: P's messages D holds that P still holds (not its consumer's one,
    # not the one D's consumer took); shipped: D's own three and P's first.
    kept = [i for i in pair.d.ids("f.q") if i.startswith("p-")]
    assert stream.messages_kept == len(kept) - 1 == p.counters["resync_kept_messages"]
    assert p.counters["resync_kept_bytes"] == stream.bytes_kept > 35 * len(BODY)
    assert stream.bytes_done < stream.bytes_kept / 5
    # enqueue: P keeps what its consumers have not taken, takes D's own
    # publishes, and none of its own messages a second time
    ids = pair.p.ids("e.q")
    assert [i for i in ids if i.startswith("d-")] == ["d-e.q-0", "d-e.q-1", "d-e.q-2"]
    assert len(ids) == len(set(ids)) and "s-2" in ids
    # wiring and the stream from here: D's next publish reaches P's replica
    pair.primary, pair.dr = pair.d, pair.p
    pair.run(pc.Publish("", "f.q", b"after", "d-after"))
    assert pair.p.ids("f.q")[-1] == "d-after"
    got = verified(pair)
    assert sorted(got) == ["e.q", "f.q"] and all(v.ok for v in got.values()), got


def test_a_switchover_after_the_failback_makes_the_old_primary_the_primary_again() -> None:
    pair = failed_over()
    adopt_and_rejoin(pair)
    resync(pair.d, pair.p)
    pair.primary, pair.dr = pair.d, pair.p
    pair.switch_over()
    assert pair.primary is pair.p
    assert runs_as_primary(pair.p.state, configured=True, reversible=True)
    assert not runs_as_primary(pair.d.state, configured=False, reversible=True)
    pair.run(pc.Publish("", "f.q", b"back", "p-back"))
    assert pair.d.ids("f.q") == pair.p.ids("f.q")
    got = verified(pair)
    assert sorted(got) == ["e.q", "f.q"] and all(v.ok for v in got.values()), got


def test_a_keep_that_does_not_match_what_the_site_holds_stages_nothing() -> None:
    pair = failed_over()
    adopt_and_rejoin(pair)
    welcome = rs.welcome_holdings(pair.p.state, "site-d", 0)
    # P's copy of a message changes after it announced it (a queue deleted
    # and declared again would do this): the digest no longer matches.
    q = pair.p.state.queues["f.q"]
    pos = pair.p.positions("f.q")[3]
    q.messages[pos] = q.messages[pos].__class__(pos, b"changed", q.messages[pos].message_id)
    plan = rs.plan_snapshot(pair.d.state, pair.d.tap.rules)
    stream = rs.SnapshotStream(
        plan,
        pair.d.tap.rules,
        origin="site-d",
        epoch=pair.d.state.epoch,
        time_us=T,
        holdings=rs.delta_holdings(welcome, 0),
        peer="site-p",
    )
    chunk = b"".join(stream.chunks())
    inc, cut, epoch = pair.d.state.incarnation, plan.cut, pair.d.state.epoch
    apply(pair.p.state, pc.ResyncStage("site-d", inc, cut, epoch, 0, chunk))
    apply(pair.p.state, pc.ResyncCommit("site-d", inc, cut, epoch, T, 1))
    p = pair.p.state
    assert p.counters["resync_keep_refused"] == 1
    assert p.rejoining == "site-d" and applied(p, "site-d", inc) == 0  # nothing installed
    assert "s-1" in pair.p.ids("f.q")
    # The egress gives up on deltas after a few: a whole resync then.
    assert rs.delta_holdings(welcome, rs.DELTA_ATTEMPTS) is None
    whole = resync(pair.d, pair.p, delta=False)
    assert whole.messages_kept == 0 and pair.p.ids("f.q") == pair.d.ids("f.q")


def test_holdings_are_announced_only_to_the_primary_a_site_rejoins_and_only_for_a_resync() -> None:
    pair = failed_over()
    assert rs.welcome_holdings(pair.p.state, "site-d", 0) == b""  # not rejoining
    adopt_and_rejoin(pair)
    assert rs.welcome_holdings(pair.p.state, "site-d", 5) == b""  # resuming: no resync
    assert rs.welcome_holdings(pair.p.state, "site-x", 0) == b""
    held = unpack_holdings_untrusted(rs.welcome_holdings(pair.p.state, "site-d", 0))
    own = pair.p.positions("f.q")
    assert held["f.q"].holds(own[0], replicated=False)
    assert not held["f.q"].holds(own[0] - 1, replicated=False)  # its consumer took it
    assert pack_holdings(held) == rs.welcome_holdings(pair.p.state, "site-d", 0)


def test_adopt_needs_a_promotion_by_failover_and_rejoin_happens_once() -> None:
    pair = loaded()
    pair.d.run(pc.Switchover("site-p", pc.SwitchoverPhase.ADOPT, T, {"swapped": 1}))
    assert not pair.d.state.swapped  # not promoted: ignored
    pair = failed_over()
    adopt_and_rejoin(pair)
    before = pair.p.state.counters["ignored"]
    pair.p.run(pc.Switchover("site-d", pc.SwitchoverPhase.REJOIN, T, {"f.q": None}))
    assert pair.p.state.counters["ignored"] == before + 1
    # Neither step is forwarded to the other site.
    event, _ = pair.p.run(pc.Switchover("site-d", pc.SwitchoverPhase.ADOPT, T, {"swapped": 1}))
    assert event is None
    # ADOPT sets the flag it names: applied twice, the same.
    pair.d.run(pc.Switchover("site-p", pc.SwitchoverPhase.ADOPT, T, {"swapped": 1}))
    assert pair.d.state.swapped


def test_the_site_queues_not_named_by_the_resync_stay_its_own() -> None:
    pair = failed_over()
    pair.p.run(pc.QueueDeclare("f.only-at-p"))
    adopt_and_rejoin(pair)
    resync(pair.d, pair.p)
    assert pair.p.state.queues["f.only-at-p"].replica is None
    assert isinstance(pair.p.state.queues["f.q"].replica, Replica)


def test_the_promoted_site_is_not_superseded_by_the_old_primary_it_replaced() -> None:
    # After ADOPT its egress dials the old primary, which refuses it (as the
    # primary it still thinks it is) until it rejoins: that refusal must not
    # turn the zombie guard on at the real primary.
    pair = failed_over()
    adopt_and_rejoin(pair)
    pair.d.run(pc.Superseded("site-p", T, {"f.q": None}))
    assert pair.d.state.superseded_by == ""
    published = pair.d.run(pc.Publish("", "f.q", b"still", "d-still"))
    assert not any(isinstance(e, Refused) for e in published)


def test_messages_the_rejoining_site_holds_from_the_primary_are_kept_too() -> None:
    # Swapped first (D the primary, P its DR site), then a forced failover
    # the other way: P promoted over D.  D rejoins P: its own messages P
    # holds replicated and P's messages D holds replicated are both kept.
    pair = loaded()
    for i in range(10):
        pair.run(pc.Publish("", "f.q", BODY, f"p-more-{i}"))
    pair.run(pc.Accept("f.q", SA, tuple(pair.p.positions("f.q")[:2])))
    pair.switch_over()
    assert pair.primary is pair.d
    for i in range(10):
        pair.run(pc.Publish("", "f.q", BODY, f"d-{i}"))  # reach P, replicated
    for i in range(4):
        pair.d.run(pc.Publish("", "f.q", BODY, f"stranded-{i}"))  # the WAN is cut
    apply(pair.p.state, pc.Promote("site-d", 9, T))
    pair.p.run(pc.Publish("", "f.q", BODY, "p-after"))
    # P, the DR site by the swap (configured primary, swapped), is the
    # primary again by ADOPT's flag.
    assert pair.p.state.swapped
    pair.p.run(pc.Switchover("site-d", pc.SwitchoverPhase.ADOPT, T, {"swapped": 0}))
    assert runs_as_primary(pair.p.state, configured=True, reversible=True)
    pair.d.run(pc.Switchover("site-p", pc.SwitchoverPhase.REJOIN, T, {"f.q": None}))
    assert not runs_as_primary(pair.d.state, configured=False, reversible=True)

    stream = resync(pair.p, pair.d)

    assert pair.d.ids("f.q") == pair.p.ids("f.q")
    assert content_digest(pair.d.state.queues["f.q"]) == content_digest(pair.p.state.queues["f.q"])
    # 11 of P's own (its first 13 less the two accepted), 10 of D's: kept
    assert stream.messages_kept == 21 == pair.d.state.counters["resync_kept_messages"]
    assert pair.d.ids("f.q")[-1] == "p-after" and "stranded-0" not in pair.d.ids("f.q")
