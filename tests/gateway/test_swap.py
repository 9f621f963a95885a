"""The sites swap roles in place at a planned switchover (cluster/state/switchover.py):
D becomes the primary at P's handover, its first event as the primary (a
``SWAP``) makes P its DR site without a resync, and a second switchover
swaps them back.  Both sites' states and taps, with every event carried to
the other as the link carries it."""

from __future__ import annotations

from cluster.siteview import describe
from cluster.state import Promoted, Reason, Refused, Verified, apply, new_state, read_only_origin
from cluster.state.model import SiteState
from cluster.state.switchover import handed_over, handover_confirmed
from cluster.state.views import applied
from filters.rules import load_rules
from gateway.fencing import refusal
from gateway.tap import ReplEvent, Tap
from protocol import cluster as pc
from protocol import link
from protocol.modes import Mode
from tests.gateway.test_tap import SA, A

# The same names at both sites, as a swap needs (docs/operations.md).
RULES = """\
version: 1
rules:
  - {name: f, match: {queue: "f.*"}, action: {mode: full}}
  - {name: e, match: {queue: "e.*"}, action: {mode: enqueue}}
  - {name: w, match: {queue: "w.*"}, action: {mode: wiring}}
default: {mode: none}
"""
T = 1_700_000_000_000_000


class Site:
    """A site's state and a tap over it, for when it is the primary."""

    def __init__(self, name: str, incarnation: int) -> None:
        self.name = name
        self.state: SiteState = new_state()
        self.tap = Tap(load_rules(RULES, "rules.yaml"), origin_cluster=name)
        apply(self.state, pc.Genesis(name, incarnation))
        apply(self.state, pc.SessionOpen(SA))
        self.tap.resync_rules(self.state)

    def run(self, cmd: pc.Command) -> tuple[ReplEvent | None, list[object]]:
        effects = apply(self.state, cmd, sender=A)
        return self.tap.on_command(self.state, cmd, effects, T), list(effects)

    def positions(self, queue: str) -> list[int]:
        return list(self.state.queues[queue].messages)

    def ids(self, queue: str) -> list[str]:
        return [m.message_id for m in self.state.queues[queue].messages.values()]


def carry(event: ReplEvent | None, to: Site) -> list[object]:
    """Apply ``event`` at ``to``, as its ingress would."""
    if event is None:
        return []
    effects: list[object] = []
    for replicated in pc.decode_frame_untrusted(event.payload):
        effects += apply(to.state, replicated)
    return effects


class Pair:
    """P replicating to D; :meth:`run` applies a command at whichever site is
    the primary now and carries its event to the other."""

    def __init__(self) -> None:
        self.p = Site("site-p", 42)
        self.d = Site("site-d", 7)
        self.primary, self.dr = self.p, self.d

    def run(self, cmd: pc.Command, at: Site | None = None) -> list[object]:
        site = at or self.primary
        event, effects = site.run(cmd)
        if site is self.primary:
            carry(event, self.dr)
        return effects

    def switch_over(self, *, swap: bool = True) -> int:
        """A planned switchover of the primary to the DR site, and (``swap``)
        the new primary's ``SWAP`` carried; the cseq of the SWAP."""
        old, new = self.primary, self.dr
        guarded = {q: None for q in ("f.q", "e.q") if q in old.state.queues}
        self.run(pc.Switchover(new.name, pc.SwitchoverPhase.QUIESCE, T, guarded))
        self.run(pc.Switchover(new.name, pc.SwitchoverPhase.HANDOVER, T, guarded))
        assert new.state.swapped == (new is self.d)  # the new primary flipped
        old.run(pc.Superseded(new.name, T, guarded))  # its egress, refused
        assert handed_over(old.state)
        event = new.tap.swap_event(new.state, old.name, T)
        if not swap:
            return event.seq
        carry(event, old)
        self.primary, self.dr = new, old
        return event.seq


def loaded() -> Pair:
    pair = Pair()
    for q in ("f.q", "e.q", "w.q", "n.q"):
        pair.run(pc.QueueDeclare(q))
    for q in ("f.q", "e.q", "n.q"):
        for i in range(3):
            pair.run(pc.Publish("", q, f"p-{q}-{i}".encode(), f"p-{q}-{i}"))
    pair.run(pc.Acquire("f.q", SA, 1, 2))  # a consumer at P holds two
    return pair


def verified(pair: Pair) -> dict[str, Verified]:
    event, _ = pair.primary.run(pc.VerifyPoint(1_000))
    return {e.queue: e for e in carry(event, pair.dr) if isinstance(e, Verified)}


def test_a_settlement_at_p_after_its_handover_is_refused_and_the_queue_stays_as_d_has_it() -> None:
    pair = loaded()
    held = pair.p.positions("f.q")[:2]
    pair.run(pc.Switchover("site-d", pc.SwitchoverPhase.QUIESCE, T, {"f.q": None}))
    pair.run(pc.Accept("f.q", SA, (held[0],)))  # before the handover: reaches D
    pair.run(pc.Switchover("site-d", pc.SwitchoverPhase.HANDOVER, T, {"f.q": None}))
    pair.run(pc.Accept("f.q", SA, (held[1],)))  # after it: D was promoted there
    assert pair.p.ids("f.q") == pair.d.ids("f.q") == ["p-f.q-1", "p-f.q-2"]
    assert pair.p.state.counters["stale_settlements"] == 1
    # Nothing more is acquired until the swap (a superseded site's consumers
    # may consume again; this one's queues must stay what D holds).
    pair.p.run(pc.Superseded("site-d", T, {"f.q": None}))
    refused = apply(pair.p.state, pc.Acquire("f.q", SA, 1, 1), sender=A)
    assert len(refused) == 1 and isinstance(refused[0], Refused)


def test_a_handover_naming_no_queue_expects_no_swap_and_freezes_nothing() -> None:
    # Configs that do not link both ways: the superseded site's consumers
    # go on as after any promotion, and nothing waits for a SWAP.
    pair = loaded()
    held = pair.p.positions("f.q")[:2]
    pair.run(pc.Switchover("site-d", pc.SwitchoverPhase.QUIESCE, T, {"f.q": None}))
    pair.run(pc.Switchover("site-d", pc.SwitchoverPhase.HANDOVER, T))
    pair.run(pc.Accept("f.q", SA, (held[0],)))
    assert pair.p.state.handover_cseq == 0
    assert pair.p.ids("f.q") == ["p-f.q-1", "p-f.q-2"]


def test_after_a_switchover_p_is_d_s_dr_site_from_d_s_swap_without_a_resync() -> None:
    pair = loaded()
    swap_at = pair.switch_over()
    p, d = pair.p.state, pair.d.state
    assert d.swapped and p.swapped
    # P's replicated queues are replicas of D, as they were: nothing shipped.
    assert {q.name: (q.replica.origin, q.replica.mode) for q in p.queues.values() if q.replica} == {
        "f.q": ("site-d", Mode.FULL),
        "e.q": ("site-d", Mode.ENQUEUE),
        "w.q": ("site-d", Mode.WIRING),
    }
    assert p.queues["n.q"].replica is None
    assert pair.p.ids("f.q") == pair.d.ids("f.q") == ["p-f.q-0", "p-f.q-1", "p-f.q-2"]
    assert p.superseded_by == "" and p.switchover_to == "" and p.handed_to == "site-d"
    assert applied(p, "site-d", 7) == swap_at
    assert read_only_origin(p, p.queues["f.q"]) == "site-d"
    # A client left behind at P is told where the queue takes publishes now;
    # what P holds of its enqueue queue is still its consumers'.
    for queue in ("f.q", "e.q"):
        (refused,) = apply(p, pc.Publish("", queue, b"x", "x"), sender=A)
        assert isinstance(refused, Refused) and refused.reason == Reason.SWITCHOVER
        assert "site-p handed its role over to site-d" in refused.description
        assert f"{queue!r} takes publishes at site-d" in refused.description
    assert not any(isinstance(e, Refused) for e in apply(p, pc.Publish("", "n.q", b"y", "y")))
    assert not any(isinstance(e, Refused) for e in apply(p, pc.Acquire("e.q", SA, 1, 1)))
    # D's stream reaches P: publishes, a consumer's accept, a verification.
    pair.run(pc.Publish("", "f.q", b"d-0", "d-f.q-0"))
    pair.run(pc.Publish("", "e.q", b"d-1", "d-e.q-0"))
    pair.run(pc.Acquire("f.q", SA, 1, 1))
    pair.run(pc.Accept("f.q", SA, (pair.d.positions("f.q")[0],)))
    assert pair.p.ids("f.q") == pair.d.ids("f.q") == ["p-f.q-1", "p-f.q-2", "d-f.q-0"]
    assert pair.p.ids("e.q")[-1] == "d-e.q-0"
    got = verified(pair)
    assert sorted(got) == ["e.q", "f.q"] and all(v.ok for v in got.values()), got


def test_the_handover_stays_confirmed_when_the_new_primary_s_swap_follows_it_at_once() -> None:
    """``drgate switchover`` polls for the handover after posting it: the
    supersession its egress records is ended by D's SWAP a few ms later (a
    fresh-clone run missed that window and waited out its timeout), so the
    command also counts the roles flipped since it began."""
    pair = loaded()
    was_swapped = pair.p.state.swapped
    assert not handover_confirmed(pair.p.state, "site-d", was_swapped)
    pair.switch_over()
    p = pair.p.state
    assert not handed_over(p)  # the supersession the egress recorded is over
    assert handover_confirmed(p, "site-d", was_swapped)
    assert not handover_confirmed(p, "site-x", was_swapped)


def test_a_late_supersession_by_the_site_it_swapped_with_is_ignored() -> None:
    """A second refusal of P's egress by D ("handed over") posted before P's
    role changed can be applied after D's SWAP: P is D's DR site by its own
    handover then, not a primary D was promoted over."""
    pair = loaded()
    pair.switch_over()
    p = pair.p.state
    ignored = p.counters["ignored"]
    apply(p, pc.Superseded("site-d", T, {"f.q": None, "e.q": None}), sender=A)
    assert p.superseded_by == "" and p.handed_to == "site-d"
    assert p.counters["ignored"] == ignored + 1
    # D's stream still reaches P.
    pair.run(pc.Publish("", "f.q", b"d-0", "d-f.q-0"))
    assert pair.p.ids("f.q")[-1] == "d-f.q-0"


def test_what_p_s_consumer_held_is_let_go_when_p_becomes_the_dr_site() -> None:
    pair = loaded()
    held = tuple(pair.p.positions("f.q")[:2])
    pair.switch_over()
    f = pair.p.state.queues["f.q"]
    assert f.acquired == {} and f.available_count() == 3
    pair.p.run(pc.Accept("f.q", SA, held))  # too late: D's consumers own them now
    assert pair.p.ids("f.q") == pair.d.ids("f.q")


def test_a_second_switchover_swaps_the_sites_back_with_both_streams_kept() -> None:
    pair = loaded()
    pair.switch_over()
    pair.run(pc.Publish("", "f.q", b"d", "d-f.q-0"))
    swap_at = pair.switch_over()
    p, d = pair.p.state, pair.d.state
    assert (p.swapped, d.swapped) == (False, False)
    assert pair.primary is pair.p
    assert {q.name: q.replica.origin for q in d.queues.values() if q.replica} == {
        "f.q": "site-p",
        "e.q": "site-p",
        "w.q": "site-p",
    }
    assert not d.origins["site-p"].promoted and applied(d, "site-p", 42) == swap_at
    assert read_only_origin(d, d.queues["f.q"]) == "site-p"
    assert read_only_origin(p, p.queues["f.q"]) is None  # P promoted over D: writable
    assert (p.handed_to, p.guarded) == ("", {})  # P's clients publish here again
    assert d.handed_to == "site-p"
    # P describes the queues it took over as its own, D as replicas of P's.
    assert queues_of(p)["f.q"]["replica"] is None
    assert queues_of(d)["f.q"]["replica"] == {"origin": "site-p", "mode": "full"}
    pair.run(pc.Publish("", "f.q", b"p", "p-f.q-3"))
    assert pair.d.ids("f.q") == pair.p.ids("f.q")
    assert pair.d.ids("f.q")[-2:] == ["d-f.q-0", "p-f.q-3"]
    got = verified(pair)
    assert all(v.ok for v in got.values()), got


def queues_of(state: SiteState) -> dict[str, dict[str, object]]:
    return {q["name"]: q for q in describe(state)["queues"]}


def test_a_forced_promotion_of_the_dr_site_it_swapped_into_opens_its_queues() -> None:
    pair = loaded()
    pair.switch_over()
    p = pair.p.state
    apply(p, pc.Promote("site-d", 5, T))  # D is lost: P takes over by a failover
    assert (p.handed_to, p.guarded) == ("", {})
    assert not any(isinstance(e, Refused) for e in apply(p, pc.Publish("", "f.q", b"x", "x")))


def test_a_swap_at_a_site_that_did_not_hand_over_changes_no_queue() -> None:
    pair = loaded()
    swap = pair.d.tap.swap_event(pair.d.state, "site-p", T)
    carry(swap, pair.p)
    assert not pair.p.state.swapped
    assert all(q.replica is None for q in pair.p.state.queues.values())


def test_the_new_primary_s_link_is_not_refused_at_the_site_that_handed_over_to_it() -> None:
    pair = loaded()
    pair.switch_over()
    pair.switch_over(swap=False)  # D handed over back to P, whose stream knocks
    hello = link.Hello("site-p", "site-d", 42, 1, 5, 1 << 20)
    assert refusal(pair.d.state, site="site-d", hello=hello) is None


def test_a_failback_at_d_ends_the_primary_role_the_handover_gave_it() -> None:
    pair = loaded()
    pair.run(pc.Switchover("site-d", pc.SwitchoverPhase.QUIESCE, T, {"f.q": None}))
    effects = pair.run(pc.Switchover("site-d", pc.SwitchoverPhase.HANDOVER, T))
    assert pair.d.state.swapped
    epoch = pair.d.state.origins["site-p"].epoch
    assert not [e for e in effects if isinstance(e, Promoted)]  # P's own effects
    apply(pair.d.state, pc.AcceptPrimary("site-p", epoch + 1))
    assert not pair.d.state.swapped
