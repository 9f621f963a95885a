"""cluster.state.snapshots: a delta transfer's elided bodies and their fill
from a joiner's recovered state (docs/broker.md "Durability")."""

from __future__ import annotations

import copy

import pytest

from cluster.state import (
    ElidedBodyMismatch,
    SiteState,
    apply,
    delta_snapshot,
    held_ranges,
    restore_untrusted,
    snapshot,
)
from cluster.state.snapshots import SNAPSHOT_VERSION
from protocol import cluster as pc
from protocol.errors import RemoteProtocolError
from tests.support.state import genesis_state

DURABLE = {pc.DURABLE_PROPERTY: True}


def publish(state: SiteState, queue: str, n: int, *, durable: bool = True, tag: str = "") -> None:
    for i in range(n):
        body = f"{tag}{queue}-{i}-".encode() * 10
        apply(state, pc.Publish("", queue, body, f"m-{i}", DURABLE if durable else {}))


def journal_and_site() -> tuple[SiteState, SiteState]:
    """A broker's recovered state, and the live site's state some time later
    (the broker was gone meanwhile: more published, some consumed)."""
    site = genesis_state("site-p", 7)
    apply(site, pc.QueueDeclare("orders", {"durable": True}))
    apply(site, pc.QueueDeclare("scratch"))
    publish(site, "orders", 50)
    publish(site, "orders", 5, durable=False)
    publish(site, "scratch", 5)
    recovered = copy.deepcopy(site)
    apply(site, pc.Purge("scratch"))
    publish(site, "orders", 20, tag="later")
    return recovered, site


def test_held_ranges_are_the_positions_of_each_durable_queue_with_messages() -> None:
    recovered, _site = journal_and_site()
    assert held_ranges(recovered) == {"orders": (1, 55)}


def test_a_delta_elides_the_held_persistent_bodies_and_the_fill_restores_the_full_state() -> None:
    recovered, site = journal_and_site()
    delta = delta_snapshot(site, held_ranges(recovered))
    full = snapshot(site)
    # 50 persistent bodies held; the 5 transient ones and the 20 later ones travel.
    assert delta.bodies_elided == 50
    assert delta.full_bytes == len(full)
    assert len(delta.data) < len(full) - delta.bytes_elided + 8 * 50
    restored = restore_untrusted(delta.data, bodies=recovered)
    assert snapshot(restored) == full


def test_without_a_journal_an_elided_body_cannot_be_filled() -> None:
    recovered, site = journal_and_site()
    delta = delta_snapshot(site, held_ranges(recovered))
    with pytest.raises(ElidedBodyMismatch, match="'orders' position 1"):
        restore_untrusted(delta.data)


def test_a_queue_deleted_and_declared_again_fails_the_crc_check() -> None:
    recovered, site = journal_and_site()
    # Positions restart at 1: the joiner's pos 1..55 are other messages now.
    apply(site, pc.QueueDelete("orders"))
    apply(site, pc.QueueDeclare("orders", {"durable": True}))
    publish(site, "orders", 30, tag="new")
    delta = delta_snapshot(site, held_ranges(recovered))
    assert delta.bodies_elided == 30
    with pytest.raises(ElidedBodyMismatch, match="holds another body"):
        restore_untrusted(delta.data, bodies=recovered)
    # The fallback: a full transfer restores without the journal.
    assert snapshot(restore_untrusted(snapshot(site))) == snapshot(site)


def test_an_empty_announcement_elides_nothing() -> None:
    _recovered, site = journal_and_site()
    delta = delta_snapshot(site, {})
    assert (delta.bodies_elided, delta.data) == (0, snapshot(site))


def test_a_version_2_snapshot_still_restores_and_cannot_elide() -> None:
    recovered, site = journal_and_site()
    assert SNAPSHOT_VERSION == 10
    # Version 9 is version 10 without the consumers' standing demand (4 bytes
    # at the end: none here).  Version 2 is version 9 without the recoveries' count, the switchover,
    # the failback and its queues, the handover, the swap and the failback
    # by delta (43 bytes at the end: none here) and without messages' broker
    # state (none here either); version 5 without the failback and its
    # queues, the handover, the swap and the rejoin (25); version 7 without
    # the handover, the swap and the rejoin (13); version 8 without the
    # rejoin (2).
    v10 = snapshot(site)
    for version, cut in ((2, 47), (5, 29), (7, 17), (8, 6), (9, 4)):
        older = v10[:4] + version.to_bytes(2, "big") + v10[6:-cut]
        assert snapshot(restore_untrusted(older)) == v10
    delta = delta_snapshot(site, held_ranges(recovered)).data
    delta_v2 = delta[:4] + (2).to_bytes(2, "big") + delta[6:-39]
    with pytest.raises(RemoteProtocolError, match="message flags"):
        restore_untrusted(delta_v2, bodies=recovered)
