"""Which stored messages a JMS selector selects (cluster/selector.py bound
to :class:`~cluster.state.effects.Message`).

Every member evaluates a consumer's selector on the same stored messages,
so it must read only what every member holds identically: the message's
bus properties (its application properties, as the publishing broker put
them in the ``Publish`` command), its id, its redelivered flag, and its
body, the encoded AMQP message, decoded (only when the selector names a JMS
header field that the bus properties do not carry).

Names a selector may use:

========================  =================================================
``JMSMessageID``          the message-id (as text)
``JMSCorrelationID``      the correlation-id (as text)
``JMSType``               the subject
``JMSPriority``           the header's priority (4 when absent)
``JMSDeliveryMode``       ``'PERSISTENT'`` (header durable) or
                          ``'NON_PERSISTENT'``
``JMSTimestamp``          the creation-time, milliseconds since the epoch
``JMSExpiration``         the absolute-expiry-time, milliseconds since the
                          epoch (0 when the message has none, as in JMS)
``JMSReplyTo``            the reply-to address
``JMSDestination``        the to address
``JMSRedelivered``        the message was delivered before
any other name            the application property of that name
========================  =================================================
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import Any

import proton

from cluster.selector import Lookup, Selector, parse_selector
from cluster.state.effects import Message
from protocol.cluster import DURABLE_PROPERTY

__all__ = ["compiled", "matcher", "message_lookup"]

# JMS header names read from the decoded AMQP message.
_FROM_BODY = frozenset(
    {
        "JMSCorrelationID",
        "JMSType",
        "JMSPriority",
        "JMSTimestamp",
        "JMSExpiration",
        "JMSReplyTo",
        "JMSDestination",
    }
)
# AMQP's default priority (section 3.2.1), which JMS reads as its own.
DEFAULT_PRIORITY = 4


@functools.lru_cache(maxsize=256)
def compiled(text: str) -> Selector:
    """The parsed selector (cached: every acquire of a consumer carries the
    same text).  Raises :class:`cluster.selector.SelectorError`."""
    return parse_selector(text)


def _plain(value: Any) -> Any:
    """A property value as a selector sees it: bool, int, float or str;
    ``None`` for what a selector cannot compare (binary, lists, maps)."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    return None


def _decoded(body: bytes) -> proton.Message | None:
    message = proton.Message()
    try:
        message.decode(body)
    except Exception:  # a body that is not an encoded AMQP message
        return None
    return message


def message_lookup(msg: Message) -> Lookup:
    """The selector's view of stored message ``msg``."""
    properties = msg.properties or {}
    decoded: list[proton.Message | None] = []

    def body() -> proton.Message | None:
        if not decoded:
            decoded.append(_decoded(bytes(msg.body)))
        return decoded[0]

    def lookup(name: str) -> Any:
        if name == "JMSMessageID":
            return msg.message_id or None
        if name == "JMSDeliveryMode":
            return "PERSISTENT" if properties.get(DURABLE_PROPERTY) else "NON_PERSISTENT"
        if name == "JMSRedelivered":
            return msg.redelivered
        if name in _FROM_BODY:
            message = body()
            if message is None:
                return DEFAULT_PRIORITY if name == "JMSPriority" else None
            if name == "JMSCorrelationID":
                cid = message.correlation_id
                return None if cid is None else str(cid)
            if name == "JMSType":
                return _plain(message.subject)
            if name == "JMSPriority":
                return int(message.priority)
            if name == "JMSExpiration":
                expiry = message.expiry_time
                return round(expiry * 1000) if expiry else 0
            if name == "JMSReplyTo":
                return _plain(message.reply_to)
            if name == "JMSDestination":
                return _plain(message.address)
            created = message.creation_time
            return round(created * 1000) if created else None
        if name == DURABLE_PROPERTY:
            return None  # the broker's own key, not an application property
        return _plain(properties.get(name))

    return lookup


def matcher(text: str) -> Callable[[Message], bool]:
    """``Message -> bool``: the messages selector ``text`` selects.  Raises
    :class:`cluster.selector.SelectorError` when it does not parse."""
    selector = compiled(text)

    def matches(msg: Message) -> bool:
        return selector.matches(message_lookup(msg))

    return matches
