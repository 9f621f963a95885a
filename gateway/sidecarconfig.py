"""A sidecar's configuration, as loaded from its file (gateway/config.py
``load_sidecar_config``; docs/operations.md, "Sidecar configuration")."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.addresses import Address
from cluster.bus import BusConfig
from cluster.tls import TlsFiles
from cluster.webconfig import WebConfig
from filters.matcher import RuleSet
from gateway.captureconfig import CaptureConfig
from gateway.linkconfig import DEFAULT_LINK_SETTINGS, LinkSettings


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    site: str  # this site's cluster id
    primary: bool  # True at P (tap + egress), False at D (ingress)
    node: int
    bus: BusConfig
    peer_cluster: str  # the other site's cluster id
    peers: tuple[Address, ...]  # the other site's sidecar link addresses, in order (P)
    listen: Address | None  # link listen address (D)
    spool_dir: str
    spool_max_bytes: int
    fsync: str
    rules: RuleSet
    tls: TlsFiles | None = None  # None: the link in plaintext (the config's insecure: true)
    # The names the peer's link certificate may carry (tls.peer_names); empty: peer_cluster.
    peer_names: tuple[str, ...] = ()
    metrics: Address | None = None
    metrics_web: WebConfig | None = None  # the endpoint's TLS and basic auth
    capture: CaptureConfig | None = None
    # P: which queues refuse publishes once D was promoted over this site
    # (gateway.config.ZOMBIE_GUARDS): full, replicated or off.
    zombie_guard: str = "full"
    # The link's ack batching, window and heartbeat (the config's link: section).
    link: LinkSettings = DEFAULT_LINK_SETTINGS
    # The file it was loaded from ("" when built in code): P re-reads its peers.
    source: str = ""

    @property
    def reversible(self) -> bool:
        """Can this sidecar link both ways (``peers`` and ``listen``), so its
        site can swap roles with the other at a planned switchover?"""
        return bool(self.peers) and self.listen is not None

    @property
    def pinned_names(self) -> tuple[str, ...]:
        """The names pinned for the link's peer certificate."""
        return self.peer_names or (self.peer_cluster,)
