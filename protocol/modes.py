"""Replication modes and the member roles, shared by every layer.

The numeric values are wire values (bus commands, link frames, capture
records): never renumber them.
"""

from __future__ import annotations

import enum


class Mode(enum.IntEnum):
    """How a queue is replicated to D (docs/architecture.md, section 1)."""

    NONE = 0  # nothing reaches D
    WIRING = 1  # declares, deletes and bindings; no messages
    ENQUEUE = 2  # declares and enqueues; D runs its own consumers
    FULL = 3  # enqueues and dequeues; D's copy is a read-only mirror

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> Mode:
        """``"full"`` -> ``Mode.FULL``; raises ``ValueError`` naming the valid labels."""
        try:
            return cls[label.upper()]
        except KeyError:
            valid = ", ".join(m.label for m in cls)
            raise ValueError(f"unknown mode {label!r}; valid modes: {valid}") from None


class Role(enum.IntEnum):
    """What a bus member is.  Wire values."""

    BROKER = 1
    SIDECAR = 2
    ADMIN = 3  # a short-lived tool (drgate admin, promote) that multicasts commands
