"""Building ``cluster.state`` site states in tests, without a bus."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.state import SiteState, apply, new_state
from protocol import cluster as pc
from protocol.values import Value


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


def p_with_messages(n: int) -> SiteState:
    """Site P (incarnation 7): q-full (``full``), q-enq (``enqueue``) with
    ``n`` messages each, q-wire (``wiring``) bound to fanout exchange ``ex``."""
    p = genesis_state("site-p", 7)
    for queue, mode in (("q-full", "all"), ("q-enq", "all"), ("q-wire", "configuration")):
        args: dict[str, Value] = {"qpid.replicate": mode}
        if queue == "q-enq":
            args["qpid.queue_event_generation"] = 1
        apply(p, pc.QueueDeclare(queue, args))
    apply(p, pc.ExchangeDeclare("ex", pc.ExchangeType.FANOUT))
    apply(p, pc.Bind("ex", "q-wire", ""))
    for i in range(1, n + 1):
        apply(p, pc.Publish("", "q-full", f"f{i}".encode(), f"m-{i}"))
        apply(p, pc.Publish("", "q-enq", f"e{i}".encode(), f"m-{i}"))
    return p


def resync_chunks(p: SiteState, *, epoch: int = 1, chunk_bytes: int = 1 << 20) -> list[bytes]:
    """P's resync snapshot (the lab's rules), in link chunks of about ``chunk_bytes``."""
    from filters.rules import load_rules
    from gateway import resync as rs
    from lab.site import LAB_RULES

    rules = load_rules(LAB_RULES.read_text(), str(LAB_RULES))
    plan = rs.plan_snapshot(p, rules)
    stream = rs.SnapshotStream(
        plan, rules, origin="site-p", epoch=epoch, time_us=123, chunk_bytes=chunk_bytes
    )
    return list(stream.chunks())
