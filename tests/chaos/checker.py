"""The chaos suite's checker: what the clients saw against what the sites hold.

Pure: it takes the clients' records and the queues' final contents, read
after quiescence, and returns the violations, first divergent message first.

Message ids are ``QUEUE-N``, N rising with every publish to QUEUE (one
publisher per queue at a time), so "in order" is "N rising".

Per queue, by the mode it ends in:

* every publish P accepted is consumed at P or still in P's queue; nothing
  P holds was refused or never sent; P's queue is in order, each id once;
* ``enqueue``: every publish P accepted was received by D's consumers or is
  still in D's queue; D's first receipts then its queue are in order; an id
  received twice at D is a duplicate unless the earlier receipt was on a
  connection that broke (its accept may never have reached the broker) or
  was never accepted (it arrived after its consumer closed), and a message
  received again must come marked redelivered; a message first received
  marked redelivered (sent before to a consumer that never recorded it) is
  outside the order check; nothing at D P did not accept;
* ``full``: D's queue equals P's, message by message and by digest (by
  digest and depth when D's replica is read-only, as a full one is);
* ``wiring``: the queue is at D and empty; ``none``: absent at D.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

ACCEPTED = "accepted"
IN_DOUBT = "in-doubt"  # sent, never settled: the broker may or may not hold it


@dataclass(slots=True)
class Delivery:
    """One message a consumer received: on connection ``conn``, which broke
    (``conn_broken``) or ended as planned; ``accepted`` when the consumer
    accepted it on an open connection; ``redelivered`` as the broker marked
    it (a delivery count above 0)."""

    message_id: str
    conn: int
    conn_broken: bool
    accepted: bool = True
    redelivered: bool = False

    @property
    def settled(self) -> bool:
        """Its accept surely reached the broker: the connection closed cleanly
        after it (a broker applies what it received before a close)."""
        return self.accepted and not self.conn_broken


@dataclass(slots=True)
class QueueRecord:
    """What the clients did with one queue and what the sites hold at the end."""

    name: str
    mode: str  # full | enqueue | wiring | none (the mode it ends in)
    published: dict[str, str] = field(default_factory=dict)  # id -> outcome
    p_deliveries: list[Delivery] = field(default_factory=list)
    d_deliveries: list[Delivery] = field(default_factory=list)
    p_final: list[str] = field(default_factory=list)
    d_final: list[str] | None = None  # None: the queue is absent at D
    # A full replica at D is read-only (no consumer may read it): then only
    # its depth and digest are known, and the digest covers every message.
    d_readable: bool = True
    d_depth: int = 0
    p_digest: str = ""
    d_digest: str = ""


def seq(message_id: str) -> int:
    return int(message_id.rsplit("-", 1)[1])


def check(records: Iterable[QueueRecord]) -> list[str]:
    """Every violation, one line each; empty when the run held every claim."""
    problems: list[str] = []
    for record in records:
        problems += check_queue(record)
    return problems


def check_queue(r: QueueRecord) -> list[str]:
    accepted = sorted((i for i, o in r.published.items() if o == ACCEPTED), key=seq)
    known = {i for i, o in r.published.items() if o in (ACCEPTED, IN_DOUBT)}
    problems = [f"{r.name} at P: {p}" for p in _check_copy(r.p_deliveries, r.p_final, accepted)]
    problems += [
        f"{r.name} at P: {i} is held but P never accepted it" for i in _unknown(r.p_final, known)
    ]
    if r.mode == "none":
        if r.d_final is not None:
            problems.append(f"{r.name} (none) exists at D with {len(r.d_final)} messages")
        return problems
    if r.d_final is None:
        return [*problems, f"{r.name} ({r.mode}) is missing at D"]
    if r.mode == "wiring":
        if r.d_final:
            problems.append(f"{r.name} (wiring) holds {r.d_final[0]} … at D: it should be empty")
    elif r.mode == "full":
        problems += _check_replica(r)
    else:
        problems += [
            f"{r.name} at D: {p}" for p in _check_copy(r.d_deliveries, r.d_final, accepted)
        ]
        seen = [d.message_id for d in r.d_deliveries] + r.d_final
        problems += [
            f"{r.name} at D: {i} is at D but P never accepted it" for i in _unknown(seen, known)
        ]
    return problems


def _check_copy(deliveries: list[Delivery], final: list[str], accepted: list[str]) -> list[str]:
    """One site's copy of a queue: consumed (``deliveries``) then still held
    (``final``): everything accepted, each once, in order."""
    problems: list[str] = []
    first: dict[str, Delivery] = {}
    order: list[str] = []
    for d in deliveries:
        earlier = first.get(d.message_id)
        if earlier is None:
            first[d.message_id] = d
            if not d.redelivered:
                # A message first seen marked redelivered went out before to a
                # consumer that never recorded it (its broker died with the
                # transfer on the wire) and came back to the queue: later ones
                # may have been taken meanwhile, so it has no place in the order.
                order.append(d.message_id)
        elif earlier.conn == d.conn or earlier.settled:
            problems.append(
                f"{d.message_id} delivered twice (connections {earlier.conn} and {d.conn}, "
                f"the first {'broken' if earlier.conn_broken else 'closed cleanly'})"
            )
        elif not d.redelivered:
            problems.append(
                f"{d.message_id} delivered again (connection {d.conn}) without the "
                f"redelivered mark after connection {earlier.conn} left it unsettled"
            )
        else:
            first[d.message_id] = d  # the receipt that counts from now on
    held = set()
    for i in final:
        if i in held:
            problems.append(f"{i} held twice")
        held.add(i)
        if i in first and first[i].settled:
            problems.append(f"{i} consumed (connection {first[i].conn}) and still held")
        if i not in first:
            order.append(i)
    for before, after in pairwise(order):
        if seq(after) <= seq(before):
            problems.append(f"{after} after {before}: out of order")
            break
    present = set(first) | held
    missing = [i for i in accepted if i not in present]
    if missing:
        problems.append(f"{missing[0]} accepted at P is lost ({len(missing)} lost in all)")
    return problems


def _check_replica(r: QueueRecord) -> list[str]:
    assert r.d_final is not None
    if not r.d_readable:
        if r.p_digest == r.d_digest and r.d_depth == len(r.p_final):
            return []
        return [
            f"{r.name} (full): D holds {r.d_depth} messages (digest {r.d_digest}), "
            f"P {len(r.p_final)} (digest {r.p_digest}), from {r.p_final[:1]} on"
        ]
    if r.d_final == r.p_final and r.p_digest == r.d_digest:
        return []
    for n, (p, d) in enumerate(zip(r.p_final, r.d_final, strict=False)):
        if p != d:
            return [f"{r.name} (full): position {n}: P holds {p}, D holds {d}"]
    if len(r.p_final) != len(r.d_final):
        longer, site = (r.p_final, "P") if len(r.p_final) > len(r.d_final) else (r.d_final, "D")
        n = min(len(r.p_final), len(r.d_final))
        return [f"{r.name} (full): only {site} holds {longer[n]} (position {n})"]
    return [f"{r.name} (full): same messages, digests differ: P {r.p_digest}, D {r.d_digest}"]


def _unknown(ids: Iterable[str], known: set[str]) -> list[str]:
    return sorted({i for i in ids if i not in known}, key=seq)[:1]
