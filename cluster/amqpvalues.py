"""Plain Python views of Proton's values: delivery outcomes and terminus fields.

The broker node sees outcomes as frozen dataclasses (:data:`Outcome`), never
Proton's ``Delivery`` state numbers; :mod:`cluster.amqp` converts both ways.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cproton
import proton
from proton import Condition, Delivery, Message

from cluster.siteview import plain
from protocol.amqpsections import PublishFields, with_broker_state
from protocol.errors import RemoteProtocolError

__all__ = [
    "ACCEPTED",
    "RELEASED",
    "TERMINAL_STATES",
    "Accepted",
    "Modified",
    "Outcome",
    "Rejected",
    "Released",
    "apply_outcome",
    "data_to_py",
    "delivery_bytes",
    "encode_annotations",
    "remote_outcome",
    "selector_filter",
    "str_keys",
    "symbols",
]


# ---------------------------------------------------------------------------
# Outcomes
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    """The message was taken (a publish is stored; a delivery is consumed)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Rejected:
    """The message is refused; ``condition`` is an AMQP error symbol."""

    condition: str = "amqp:internal-error"
    description: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Released:
    """Not processed; may be delivered again (to anyone)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Modified:
    """Like released, with the flags AMQP's ``modified`` outcome carries."""

    delivery_failed: bool = False
    undeliverable_here: bool = False
    annotations: dict[str, Any] | None = None


Outcome = Accepted | Rejected | Released | Modified


def encode_annotations(annotations: dict[str, Any] | None) -> bytes:
    """``annotations`` (a ``modified`` outcome's) as an encoded AMQP map with
    symbol keys, values typed as Proton decoded them; ``b""`` for none."""
    if not annotations:
        return b""
    data = proton.Data()
    data.put_dict({proton.symbol(k): v for k, v in annotations.items()})
    return bytes(data.encode())


ACCEPTED = Accepted()
RELEASED = Released()


def apply_outcome(dlv: Delivery, outcome: Outcome) -> None:
    """Set our local disposition on ``dlv`` (does not settle)."""
    if isinstance(outcome, Accepted):
        # Proton's update first copies the local disposition's data,
        # annotations and condition (three wrappers made and read); an
        # accepted has none of them, and every publish is settled so.
        cproton.pn_delivery_update(dlv._impl, cproton.PN_ACCEPTED)
    elif isinstance(outcome, Rejected):
        dlv.local.condition = Condition(outcome.condition, outcome.description or None)
        dlv.update(Delivery.REJECTED)
    elif isinstance(outcome, Released):
        dlv.update(Delivery.RELEASED)
    elif isinstance(outcome, Modified):
        dlv.local.failed = outcome.delivery_failed
        dlv.local.undeliverable = outcome.undeliverable_here
        if outcome.annotations:
            dlv.local.annotations = {proton.symbol(k): v for k, v in outcome.annotations.items()}
        dlv.update(Delivery.MODIFIED)
    else:  # pragma: no cover - exhaustive
        raise TypeError(f"not an outcome: {outcome!r}")


def remote_outcome(dlv: Delivery) -> Outcome:
    """The outcome the client gave ``dlv``.

    A delivery the client settled without any outcome counts as released:
    the client acknowledged nothing, so nothing may be lost.
    """
    state = dlv.remote_state
    if state == Delivery.ACCEPTED:
        return ACCEPTED
    if state == Delivery.REJECTED:
        cond = dlv.remote.condition
        if cond is None:
            return Rejected()
        return Rejected(str(cond.name), cond.description or "")
    if state == Delivery.MODIFIED:
        ann = dlv.remote.annotations
        return Modified(
            delivery_failed=bool(dlv.remote.failed),
            undeliverable_here=bool(dlv.remote.undeliverable),
            annotations={str(k): v for k, v in ann.items()} if ann else None,
        )
    return RELEASED


TERMINAL_STATES = frozenset(
    {Delivery.ACCEPTED, Delivery.REJECTED, Delivery.RELEASED, Delivery.MODIFIED}
)


# ---------------------------------------------------------------------------
# Terminus fields
# ---------------------------------------------------------------------------


def data_to_py(data: proton.Data) -> Any:
    """Decode a terminus Data (map or array); ``None`` when empty."""
    data.rewind()
    if not data.next():
        return None
    return data.get_object()


def str_keys(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items()}


def symbols(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (str(value),)
    try:
        return tuple(str(v) for v in value)
    except TypeError:
        return ()


# ---------------------------------------------------------------------------
# Source filters
# ---------------------------------------------------------------------------

# The JMS selector filter: its descriptor as a symbol and as a code (the
# Apache filter registry), and the key clients that send a bare string use.
SELECTOR_DESCRIPTOR = "apache.org:selector-filter:string"
SELECTOR_CODE = 0x0000468C00000004
SELECTOR_KEY = "jms-selector"


class FilterRefusal(ValueError):
    """A source filter the broker does not apply; ``condition`` and the
    message (naming the filter and the fix) are for the detach."""

    def __init__(self, condition: str, description: str) -> None:
        super().__init__(description)
        self.condition = condition
        self.description = description


def _descriptor(value: Any) -> str:
    descriptor = value.descriptor
    if isinstance(descriptor, int):
        return f"0x{int(descriptor):016x}"
    return str(descriptor)


def selector_filter(filters: dict[str, Any]) -> str | None:
    """The JMS selector text of a source's filter map (``None``: no
    selector).  Raises :class:`FilterRefusal` for a filter that is not a
    selector (``amqp:not-implemented``) or a selector that is not a string
    or not alone (``amqp:invalid-field``): a broker answers an attach with
    only the filters it applies, and applies nothing else."""
    found: list[tuple[str, str]] = []
    for key, value in filters.items():
        if isinstance(value, proton.Described):
            descriptor = value.descriptor
            is_selector = (isinstance(descriptor, int) and int(descriptor) == SELECTOR_CODE) or (
                isinstance(descriptor, str) and str(descriptor) == SELECTOR_DESCRIPTOR
            )
            if not is_selector:
                raise FilterRefusal(
                    "amqp:not-implemented",
                    f"source filter {key!r} (descriptor {_descriptor(value)!r}) is not "
                    f"supported: this broker applies only the JMS selector filter "
                    f"({SELECTOR_DESCRIPTOR}); attach without it",
                )
            text = value.value
        elif key == SELECTOR_KEY:
            text = value
        else:
            raise FilterRefusal(
                "amqp:not-implemented",
                f"source filter {key!r} ({value!r}) is not supported: this broker applies "
                f"only the JMS selector filter ({SELECTOR_DESCRIPTOR}); attach without it",
            )
        if not isinstance(text, str):
            raise FilterRefusal(
                "amqp:invalid-field",
                f"source filter {key!r}: a JMS selector must be a string, got {text!r}",
            )
        found.append((key, str(text)))
    if len(found) > 1:
        keys = ", ".join(repr(k) for k, _ in found)
        raise FilterRefusal(
            "amqp:invalid-field",
            f"source filters {keys} are all JMS selectors; give one (combine them with AND)",
        )
    return found[0][1] if found else None


def fields_of_message(message: Message) -> PublishFields:
    """The :class:`PublishFields` of a message Proton decoded."""
    return PublishFields(
        bool(message.durable),
        "" if message.id is None else str(message.id),
        message.address,
        message.subject,
        {str(k): plain(v) for k, v in _properties(message).items()},
    )


def wrap(cls: Any, impl: Any) -> Any:
    """Proton's wrapper of class ``cls`` for the engine object ``impl``;
    None for a null one (Proton's ``wrap`` is untyped)."""
    return cls.wrap(impl)


def _properties(message: Message) -> dict[Any, Any]:
    return dict(message.properties or {})


# ---------------------------------------------------------------------------
# A stored message as it goes out to a consumer
# ---------------------------------------------------------------------------

# How an encoded AMQP message begins: a described section (descriptor 0x00,
# then a small or a full ulong code).
_SECTION_STARTS = frozenset({b"\x00\x53", b"\x00\x80"})


def delivery_bytes(msg: Any) -> bytes:
    """The AMQP message to send for stored message ``msg``: its body as
    published (an encoded AMQP message: this broker and the origin site's
    store what their publishers sent), with what the brokers own put over
    it -- the delivery count raised by the failed deliveries, the
    annotations of ``modified`` outcomes merged -- and every other section
    as it was (protocol/amqpsections.py).  A body that is not an encoded
    message is sent as the body of one."""
    body = bytes(msg.body)
    if not msg.delivery_count and not msg.annotations and body[:2] in _SECTION_STARTS:
        return body
    try:
        return with_broker_state(body, msg.delivery_count, msg.annotations)
    except RemoteProtocolError:  # a body that is not an encoded AMQP message
        message = Message(body=body)
        message.delivery_count = msg.delivery_count
        return bytes(message.encode())
