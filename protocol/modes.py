"""Replication modes, the member roles, and the Qpid queue arguments that
select a mode, shared by every layer.

The numeric values are wire values (bus commands, link frames, capture
records): never renumber them.

Qpid arguments, both ways
-------------------------
A queue asks for a mode with its declare arguments, as in Qpid:
:func:`declare_args` gives the arguments for a mode (what ``drgate admin
add-queue --replicate`` sets), :func:`from_args_mode` reads the mode back
(the rules' ``from-args`` action, docs/rules.md), and
:func:`check_declare_args` says what is wrong with a local declare's
arguments (the state machine refuses such a declare).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any


class Mode(enum.IntEnum):
    """How a queue is replicated to D (docs/architecture.md, section 1)."""

    NONE = 0  # nothing reaches D
    WIRING = 1  # declares, deletes and bindings; no messages
    ENQUEUE = 2  # declares and enqueues; D runs its own consumers
    FULL = 3  # enqueues and dequeues; D's copy is a read-only mirror

    @property
    def label(self) -> str:
        # A table, not name.lower(): the tap counts a label per forwarded command.
        return _MODE_LABELS[self]

    @classmethod
    def from_label(cls, label: str) -> Mode:
        """``"full"`` -> ``Mode.FULL``; raises ``ValueError`` naming the valid labels."""
        try:
            return cls[label.upper()]
        except KeyError:
            valid = ", ".join(m.label for m in cls)
            raise ValueError(f"unknown mode {label!r}; valid modes: {valid}") from None


_MODE_LABELS: dict[Mode, str] = {m: m.name.lower() for m in Mode}


class Role(enum.IntEnum):
    """What a bus member is.  Wire values."""

    BROKER = 1
    SIDECAR = 2
    ADMIN = 3  # a short-lived tool (drgate admin, promote) that multicasts commands


# --------------------------------------------------------------------------
# Qpid queue arguments
# --------------------------------------------------------------------------

REPLICATE_ARG = "qpid.replicate"
REPLICATE_VALUES = ("all", "configuration", "none")
EVENT_GENERATION_ARG = "qpid.queue_event_generation"
# ``drgate replicate pause|resume QUEUE``: true stops forwarding the queue
# (whatever its mode) until it is false again (docs/operations.md).
PAUSED_ARG = "x-drgate-replication-paused"
EVENT_GENERATION_VALUES = (1, 2)
MAX_COUNT_ARGS = ("qpid.max_count", "max_depth")
"""Queue arguments giving the maximum number of messages (first found wins)."""
MAX_SIZE_ARG = "qpid.max_size"
# Durability (docs/broker.md, "Durability"): a queue or exchange declared with
# ``durable`` true survives a whole-site restart; ``qpid.persist_last_node``
# makes every message of its queue persistent (and the queue durable);
# ``qpid.file_size`` / ``qpid.file_count`` size a Qpid queue's own store and
# are accepted and ignored (a node has one journal, cluster/journal.py).
DURABLE_ARG = "durable"
PERSIST_LAST_NODE_ARG = "qpid.persist_last_node"
FLAG_ARGS = (DURABLE_ARG, PERSIST_LAST_NODE_ARG)
_FLAG_TEXTS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
"""Queue argument giving the maximum total body bytes."""

_DECLARE_ARGS: dict[Mode, dict[str, str | int]] = {
    Mode.FULL: {REPLICATE_ARG: "all", EVENT_GENERATION_ARG: 2},
    Mode.ENQUEUE: {REPLICATE_ARG: "all", EVENT_GENERATION_ARG: 1},
    Mode.WIRING: {REPLICATE_ARG: "configuration"},
    Mode.NONE: {REPLICATE_ARG: "none"},
}


def declare_args(mode: Mode) -> dict[str, str | int]:
    """The declare arguments that ask for ``mode`` (a new dict each call):

    =========  ==================================================================
    full       qpid.replicate=all, qpid.queue_event_generation=2
    enqueue    qpid.replicate=all, qpid.queue_event_generation=1
    wiring     qpid.replicate=configuration
    none       qpid.replicate=none
    =========  ==================================================================
    """
    return dict(_DECLARE_ARGS[mode])


def as_text(value: Any) -> str:
    """How header and argument values are compared: as text.

    ``True`` -> ``"true"``, ``1`` -> ``"1"``, bytes are decoded as UTF-8.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def from_args_mode(args: Mapping[str, Any] | None, fallback: Mode) -> tuple[Mode, str]:
    """The ``from-args`` table (docs/rules.md): mode and why.

    ===================  ==========================  =========
    ``qpid.replicate``   ``queue_event_generation``  mode
    ===================  ==========================  =========
    ``none``             any                         none
    ``configuration``    any                         wiring
    ``all``              ``1``                       enqueue
    ``all``              absent, ``0``, ``2``, other full
    absent / other       ``1``                       enqueue
    absent / other       ``2``                       full
    absent / other       absent, ``0``, other        fallback
    ===================  ==========================  =========
    """
    replicate = None
    generation = None
    if args:
        if REPLICATE_ARG in args:
            replicate = as_text(args[REPLICATE_ARG]).strip().lower()
        if EVENT_GENERATION_ARG in args:
            generation = as_text(args[EVENT_GENERATION_ARG]).strip()
    if replicate == "none":
        return Mode.NONE, "qpid.replicate=none"
    if replicate == "configuration":
        return Mode.WIRING, "qpid.replicate=configuration"
    if replicate == "all":
        if generation == "1":
            return Mode.ENQUEUE, "qpid.replicate=all, qpid.queue_event_generation=1"
        return Mode.FULL, "qpid.replicate=all"
    if generation == "1":
        return Mode.ENQUEUE, "qpid.queue_event_generation=1"
    if generation == "2":
        return Mode.FULL, "qpid.queue_event_generation=2"
    return fallback, "no replication argument: the rule's fallback"


def replication_paused(args: Mapping[str, Any] | None) -> bool:
    """The queue's replication is paused (its ``PAUSED_ARG`` reads true)."""
    if not args:
        return False
    return as_text(args.get(PAUSED_ARG, "")).strip().lower() == "true"


def limit_value(value: Any) -> int | None:
    """A limit argument as a non-negative int, or None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)  # "¹" is a digit to str.isdigit(), not to int()
    return None


def flag_value(value: Any) -> bool | None:
    """A yes/no argument as a bool (``True``/``False``, 1/0, or the texts
    true/false, yes/no, 1/0 in any case), or None when it is not one."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return {1: True, 0: False}.get(value)
    if isinstance(value, str):
        return _FLAG_TEXTS.get(value.strip().lower())
    return None


def declare_refused(queue: str, problem: str) -> str:
    """The text a refused declare of ``queue`` gives its client (docs/broker.md)."""
    return f"cannot declare queue {queue!r}: {problem}"


def check_declare_args(args: Mapping[str, Any]) -> str | None:
    """What is wrong with a local declare's arguments, for a person; None if
    nothing is.  Stricter than :func:`from_args_mode`, which reads any value:
    a local client must spell the mode as Qpid does."""
    if REPLICATE_ARG in args and args[REPLICATE_ARG] not in REPLICATE_VALUES:
        return (
            f"{REPLICATE_ARG}={args[REPLICATE_ARG]!r} is not one of {', '.join(REPLICATE_VALUES)}"
        )
    if EVENT_GENERATION_ARG in args:
        value = args[EVENT_GENERATION_ARG]
        if limit_value(value) not in EVENT_GENERATION_VALUES:
            return f"{EVENT_GENERATION_ARG}={value!r} is not 1 or 2"
    for key in (*MAX_COUNT_ARGS, MAX_SIZE_ARG):
        if key in args and limit_value(args[key]) is None:
            return f"{key}={args[key]!r} is not a non-negative integer"
    for key in FLAG_ARGS:
        if key in args and flag_value(args[key]) is None:
            return f"{key}={args[key]!r} is not true or false"
    return None
