"""A message sent at P is the message read at D, byte for byte (issue 24):
two data sections, a footer, a list32 properties section, and a null
amqp-value body, over the bus, the tap, the WAN and D's bus (lab.site.TwoSites,
embedded bus, one node per site; an ``enqueue`` queue, which D's clients may
consume)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from proton import Delivery
from proton.utils import BlockingConnection

from lab.site import TwoSites
from tests.cluster.test_node_passthrough import NULL_BODY, TWO_DATA_SECTIONS, RawReceiver
from tests.lab import queues, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

TIMEOUT_S = 60.0


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoSites]:
    with TwoSites(workdir=tmp_path, nodes=1) as sites:
        done = sites.p.admin(1, "add-queue", "q-enq", "--replicate", "enqueue")
        assert done.returncode == 0, done.stderr
        yield sites


def test_what_p_took_is_what_d_delivers_byte_for_byte(two: TwoSites) -> None:
    conn = BlockingConnection(two.p.amqp[1], timeout=TIMEOUT_S)
    try:
        sender = conn.create_sender("q-enq")
        for i, payload in enumerate((TWO_DATA_SECTIONS, NULL_BODY)):
            delivery = sender.link.delivery(str(i))
            sender.link.stream(payload)
            sender.link.advance()
            conn.wait(lambda d=delivery: d.remote_state != 0, timeout=TIMEOUT_S)
            assert delivery.remote_state == Delivery.ACCEPTED
    finally:
        conn.close()
    wait_for(
        "D holds both messages",
        lambda: queues(two.d.describe(1)).get("q-enq", {}).get("depth") == 2,
    )
    conn = BlockingConnection(two.d.amqp[1], timeout=TIMEOUT_S)
    try:
        raw = RawReceiver()
        receiver = conn.create_receiver("q-enq", credit=2, handler=raw)
        conn.wait(lambda: len(raw.payloads) >= 2, timeout=TIMEOUT_S)
        for dlv in raw.deliveries:
            dlv.update(Delivery.ACCEPTED)
            dlv.settle()
        receiver.close()
    finally:
        conn.close()
    assert raw.payloads == [TWO_DATA_SECTIONS, NULL_BODY]
