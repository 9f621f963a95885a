"""The sidecar config's ``link:`` section: the WAN link's ack batching, window,
heartbeat and verification period (:class:`LinkSettings`) and its YAML loader.

P's egress uses ``window_bytes`` (proposed in HELLO), ``linger_ms``,
``heartbeat_ms`` / ``heartbeat_timeout_ms`` and ``verify_s``
(gateway/verification.py); D's ingress uses ``ack_events`` / ``ack_ms``
(``qpid-route --ack N``'s counterpart), ``heartbeat_timeout_ms``, and grants
the smaller of its own ``window_bytes`` and P's.  Both ends take the section;
a key one end does not use is accepted there, so P and D can share a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from filters.yamldoc import Node, Problems, check_keys, expect_int
from protocol import link
from protocol.link.receiver import DEFAULT_ACK_DELAY, DEFAULT_ACK_EVERY_EVENTS
from protocol.link.sender import (
    DEFAULT_BATCH_MAX_BYTES,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_LINGER,
    DEFAULT_PING_INTERVAL,
    DEFAULT_WINDOW_BYTES,
)

__all__ = ["DEFAULT_LINK_SETTINGS", "LinkSettings", "load_link_settings"]

# The defaults are the link machines' own (their reasons are written there):
# 256 events or 20 ms per ACK, an 8 MiB window, a ping every 5 s and a peer
# silent for 15 s is dead.
DEFAULT_ACK_MS: Final = round(DEFAULT_ACK_DELAY * 1000)
DEFAULT_HEARTBEAT_MS: Final = round(DEFAULT_PING_INTERVAL * 1000)
DEFAULT_HEARTBEAT_TIMEOUT_MS: Final = round(DEFAULT_HEARTBEAT_TIMEOUT * 1000)
DEFAULT_LINGER_MS: Final = round(DEFAULT_LINGER * 1000)
# A batch held a second is a second of lag at every load.
MAX_LINGER_MS: Final = 1_000
# A window must hold one full batch, or the sender could never fill a batch.
MIN_WINDOW_BYTES: Final = DEFAULT_BATCH_MAX_BYTES
# The HELLO field is a u32.
MAX_WINDOW_BYTES: Final = 2**32 - 1
# An ACK held longer than 10 s leaves P's window and spool waiting for nothing.
MAX_ACK_MS: Final = 10_000
MAX_HEARTBEAT_MS: Final = 600_000
KEYS: Final = (
    "ack_events",
    "ack_ms",
    "window_bytes",
    "linger_ms",
    "heartbeat_ms",
    "heartbeat_timeout_ms",
    "verify_s",
)
# Continuous verification (gateway/verification.py): a comparison a minute
# costs one digest of each full queue a minute; at most one a day.
DEFAULT_VERIFY_S: Final = 60
MAX_VERIFY_S: Final = 86_400


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """The sidecar config's ``link:`` section (every key optional)."""

    ack_events: int = DEFAULT_ACK_EVERY_EVENTS  # D: an ACK after this many applied events
    ack_ms: int = DEFAULT_ACK_MS  # D: ... or this long after the first unacked one
    window_bytes: int = DEFAULT_WINDOW_BYTES  # unacked event bytes in flight
    heartbeat_ms: int = DEFAULT_HEARTBEAT_MS  # P: a PING after this long without a frame
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS  # a peer silent this long is dead
    verify_s: int = DEFAULT_VERIFY_S  # P: the sites compare their copies this often (0: never)
    linger_ms: int = DEFAULT_LINGER_MS  # P: an event waits this long for others to share its batch

    def sender_config(
        self, origin: str, target: str, *, incarnation: int, epoch: int
    ) -> link.SenderConfig:
        """The egress's link settings."""
        return link.SenderConfig(
            origin_cluster=origin,
            target_cluster=target,
            incarnation=incarnation,
            epoch=epoch,
            window_bytes=self.window_bytes,
            linger=self.linger_ms / 1000,
            ping_interval=self.heartbeat_ms / 1000,
            heartbeat_timeout=self.heartbeat_timeout_ms / 1000,
        )

    def receiver_config(self, cluster_id: str) -> link.ReceiverConfig:
        """The ingress's link settings."""
        return link.ReceiverConfig(
            cluster_id=cluster_id,
            ack_every_events=self.ack_events,
            ack_delay=self.ack_ms / 1000,
            heartbeat_timeout=self.heartbeat_timeout_ms / 1000,
        )


DEFAULT_LINK_SETTINGS: Final = LinkSettings()
"""Every key at its default (a frozen value: safe as a dataclass default)."""


def load_link_settings(node: Node, problems: Problems) -> LinkSettings:
    """Parse the ``link:`` section; mistakes go to ``problems`` (file:line:column).

    Example (the defaults)::

        link:
          ack_events: 256              # D acks after this many applied events
          ack_ms: 20                   # ... or this long after the first unacked one
          window_bytes: 8388608        # unacked bytes in flight (D grants min(P's, its own))
          linger_ms: 0                 # P: how long an event waits for more to fill its batch
          heartbeat_ms: 5000           # P pings after this long without sending
          heartbeat_timeout_ms: 15000  # a peer silent this long is dead (> heartbeat_ms)
          verify_s: 60                 # P: the sites compare their copies this often (0: never)
    """
    fields = check_keys(node, problems, what="'link'", optional=KEYS)
    if fields is None:
        return LinkSettings()
    limits = {
        "ack_events": (1, 1_000_000),
        "ack_ms": (1, MAX_ACK_MS),
        "window_bytes": (MIN_WINDOW_BYTES, MAX_WINDOW_BYTES),
        "heartbeat_ms": (100, MAX_HEARTBEAT_MS),
        "heartbeat_timeout_ms": (200, MAX_HEARTBEAT_MS),
        "verify_s": (0, MAX_VERIFY_S),
        "linger_ms": (0, MAX_LINGER_MS),
    }
    values: dict[str, int] = {}
    for key, (low, high) in limits.items():
        if key in fields:
            value = expect_int(
                fields[key], problems, what=f"'link.{key}'", minimum=low, maximum=high
            )
            if value is not None:
                values[key] = value
    settings = LinkSettings(**values)
    if settings.heartbeat_timeout_ms <= settings.heartbeat_ms:
        where = fields.get("heartbeat_timeout_ms", fields.get("heartbeat_ms", node))
        problems.error(
            where.location,
            f"'link.heartbeat_timeout_ms' ({settings.heartbeat_timeout_ms}) must be more than "
            f"'link.heartbeat_ms' ({settings.heartbeat_ms}): every ping would time out",
            "make the timeout about three heartbeats, e.g. "
            f"heartbeat_timeout_ms: {3 * settings.heartbeat_ms}",
        )
    return settings
