"""Digests of a queue's contents: equal digests mean the same messages in
the same order, whichever site holds them (the chaos checker's "full
replicas equal", continuous verification).  Pure functions of the state."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

from cluster.state.effects import Message
from cluster.state.model import Queue, SiteState
from protocol.values import pack_value_map

__all__ = ["content_digest", "kept_digest", "queue_digest"]

# Per message: identity pos u64 | 0 u64 | has properties u8 | message id length u16
# (the layout of a snapshot's message record, so older digests stay valid).
_MSG = struct.Struct(">QQBH")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


def queue_digest(state: SiteState, queue: str) -> str | None:
    """sha256 (hex) of one queue's contents as another site would see them:
    the queue name, then per message in FIFO order its identity position
    (origin pos for a replicated message, else its pos), message id,
    properties and body.  Acquisition, redelivery and arguments are left out,
    so a ``full`` replica at D digests like P's queue.  None if no such queue.
    """
    q = state.queues.get(queue)
    if q is None:
        return None
    return _messages_digest(q, q.name)


def content_digest(q: Queue) -> str:
    """:func:`queue_digest` without the name: a replica whose name the rules
    mapped digests like its origin queue (continuous verification)."""
    return _messages_digest(q, None)


def _messages_digest(q: Queue, name: str | None) -> str:
    h = hashlib.sha256()
    out: list[bytes] = []
    if name is not None:
        raw = name.encode("utf-8")
        out.append(_U16.pack(len(raw)))
        out.append(raw)
    for m in q.messages.values():
        mid = m.message_id.encode("utf-8")
        out.append(_MSG.pack(m.identity_pos, 0, 0 if m.properties is None else 1, len(mid)))
        out.append(mid)
        if m.properties is not None:
            out.append(pack_value_map(m.properties))
        out.append(_U32.pack(len(m.body)))
        out.append(m.body)
        if len(out) > 4096:
            h.update(b"".join(out))
            out.clear()
    h.update(b"".join(out))
    return h.hexdigest()


def kept_digest(messages: Iterable[Message]) -> bytes:
    """8 bytes over the ids, properties and bodies of ``messages`` in order
    (positions left out: the two sites number them differently): what a
    ``Keep`` of a failback by delta claims the receiver holds, and what the
    receiver checks before it stages its own copies."""
    h = hashlib.blake2b(digest_size=8)
    for m in messages:
        mid = m.message_id.encode("utf-8")
        h.update(_U16.pack(len(mid)))
        h.update(mid)
        props = b"" if m.properties is None else pack_value_map(m.properties)
        h.update(_U32.pack(len(props)))
        h.update(props)
        h.update(_U32.pack(len(m.body)))
        h.update(m.body)
    return h.digest()
