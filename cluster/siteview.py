"""What a broker node reads from its copy of the site state, and the bus
commands of an admin request (cluster/node.py answers with these).

The queries let a client hear "no" at attach rather than at its first
message; the state machine re-checks everything when the command is applied.
"""

from __future__ import annotations

from typing import Any

from cluster import state as st
from cluster.state.merge import PROMOTE_HINT
from cluster.state.model import SiteState
from protocol import cluster as pc
from protocol.errors import DrgateError
from protocol.values import Value

__all__ = [
    "admin_commands",
    "available",
    "describe",
    "has_exchange",
    "has_queue",
    "plain",
    "read_only_refusal",
]


def admin_commands(request: dict[str, Any]) -> list[pc.Command]:
    """Bus commands for one admin request (the JSON body sent to $drgate.admin)."""
    op = request["op"]
    name = str(request.get("name", ""))
    args = {str(k): plain(v) for k, v in (request.get("args") or {}).items()}
    if op == "add-queue":
        return [pc.QueueDeclare(name, args)]
    if op == "del-queue":
        return [pc.QueueDelete(name)]
    if op == "purge":
        return [pc.Purge(name)]
    if op == "add-exchange":
        kind = pc.ExchangeType[str(request.get("type", "direct")).upper()]
        return [pc.ExchangeDeclare(name, kind, args)]
    if op == "del-exchange":
        return [pc.ExchangeDelete(name)]
    if op == "bind":
        return [pc.Bind(name, str(request["queue"]), str(request.get("key", "")), args)]
    if op == "unbind":
        return [pc.Unbind(name, str(request["queue"]), str(request.get("key", "")))]
    raise DrgateError(
        f"unknown admin operation {op!r}; valid: add-queue, del-queue, purge, add-exchange, "
        "del-exchange, bind, unbind"
    )


def plain(value: Any) -> Value:
    """An AMQP value as a bus map value (symbols and other str subclasses
    become str; anything else unsupported becomes its text)."""
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes | memoryview):  # Proton decodes a binary as a memoryview
        return bytes(value)
    return str(value)


def has_queue(state: SiteState, name: str) -> bool:
    return name in state.queues


def has_exchange(state: SiteState, name: str) -> bool:
    return name in state.exchanges


def available(state: SiteState, queue: str) -> int:
    q = state.queues.get(queue)
    return 0 if q is None else q.available_count()


def read_only_refusal(state: SiteState, queue: str) -> tuple[str, str] | None:
    """``(condition, description)`` when R3 makes ``queue`` read-only here."""
    q = state.queues.get(queue)
    origin = None if q is None else st.read_only_origin(state, q)
    if origin is None:
        return None
    return (
        "amqp:not-allowed",
        f"queue {queue!r} is a read-only replica of site {origin!r} (mode full) "
        f"while replication is active; to use it here, promote this site over {origin!r} "
        f"({PROMOTE_HINT})",
    )


def describe(state: SiteState) -> dict[str, Any]:
    queues = []
    for q in state.queues.values():
        queues.append(
            {
                "name": q.name,
                "depth": q.depth,
                "acquired": len(q.acquired),
                "bytes": q.bytes,
                "digest": st.queue_digest(state, q.name),
                "args": {k: v if not isinstance(v, bytes) else v.hex() for k, v in q.args.items()},
                "replica": None
                if q.replica is None or q.replica.origin in state.handovers
                else {"origin": q.replica.origin, "mode": q.replica.mode.label},
            }
        )
    exchanges = []
    for x in state.exchanges.values():
        exchanges.append(
            {
                "name": x.name,
                "type": x.type.name.lower(),
                "bindings": [{"queue": qn, "key": key} for qn, key in x.bindings],
            }
        )
    return {
        "incarnation": state.incarnation,
        "cseq": state.cseq,
        "queues": queues,
        "exchanges": exchanges,
        "digest": st.digest(state),
    }
