"""A primary's own epoch and the zombie guard, in the state machine.

After D was promoted, the old primary's brokers must stop settling publishes
that can never reach D (``Superseded``), until the operator makes it the
primary again at the epoch D accepts it at (``SetEpoch``).  Both are part of
the replicated state, so every broker of the site refuses alike and a member
that joins later refuses too."""

from __future__ import annotations

from cluster import state as st
from cluster.state.effects import Reason, Refused, Settled
from protocol import cluster as pc
from tests.support.state import Member, genesis_state

CLIENT = Member(1, 100)


def _primary() -> st.SiteState:
    p = genesis_state("site-p", 7)
    for queue in ("orders", "audit", "local"):
        st.apply(p, pc.QueueDeclare(queue))
    st.apply(p, pc.ExchangeDeclare("fan", pc.ExchangeType.FANOUT))
    st.apply(p, pc.Bind("fan", "orders", ""))
    st.apply(p, pc.Bind("fan", "local", ""))
    return p


def _publish(p: st.SiteState, exchange: str, key: str, ref: int) -> list[object]:
    return st.apply(p, pc.Publish(exchange, key, b"x", f"m-{ref}", ref=ref), sender=CLIENT)


def test_a_superseded_primary_refuses_publishes_to_guarded_queues_with_the_reason() -> None:
    p = _primary()
    assert p.epoch == 1
    st.apply(p, pc.Superseded("site-d", 1_700_000_000_000_000, {"orders": None, "audit": None}))
    effects = _publish(p, "", "orders", 1)
    (refused,) = [e for e in effects if isinstance(e, Refused)]
    assert refused.reason is Reason.SUPERSEDED
    assert refused.condition == "amqp:precondition-failed"
    assert "site-d was promoted over site-p" in refused.description
    assert "'orders'" in refused.description
    # All or nothing: a fanout that reaches a guarded queue is refused whole.
    assert any(isinstance(e, Refused) for e in _publish(p, "fan", "", 2))
    assert p.queues["local"].depth == 0 and p.queues["orders"].depth == 0
    # Queues that are not guarded take messages as before.
    assert any(isinstance(e, Settled) for e in _publish(p, "", "local", 3))
    # A later report changes nothing; a member that joins now refuses alike.
    st.apply(p, pc.Superseded("site-x", 5, {}))
    joined = st.restore_untrusted(st.snapshot(p))
    assert (joined.superseded_by, joined.guarded) == ("site-d", {"orders": None, "audit": None})
    assert st.digest(joined) == st.digest(p)


def test_set_epoch_moves_the_primarys_epoch_up_only_and_lifts_the_guard() -> None:
    p = _primary()
    st.apply(p, pc.Superseded("site-d", 1, {"orders": None}))
    st.apply(p, pc.SetEpoch(1))  # not above the current epoch: ignored
    assert p.epoch == 1 and p.superseded_by == "site-d"
    st.apply(p, pc.SetEpoch(3))
    assert (p.epoch, p.superseded_by) == (3, "")
    # Publishes are taken again; consumers wait for D (cluster/state/switchover.py).
    assert (p.guarded, p.failback_cseq) == ({"orders": None}, p.cseq)
    assert any(isinstance(e, Settled) for e in _publish(p, "", "orders", 4))
    assert st.restore_untrusted(st.snapshot(p)).epoch == 3
