"""A broker node passes the bare message through byte for byte
(cluster/amqp.py, cluster/node.py, protocol/amqpsections.py): what a
consumer on another broker of the site receives is what the publisher sent,
several data sections, a null body, a footer and list32 encodings
included; the broker changes only the header and annotations it owns.
Malformed messages are rejected with amqp:decode-error.

Real ``BrokerNode`` instances on one in-memory bus, Proton's blocking client
in a worker thread, sending and reading raw transfer payloads."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from proton import Delivery, Event, Message
from proton.utils import BlockingConnection

from protocol.amqpsections import header_delivery_count_untrusted, split_message_untrusted
from tests.cluster.test_node_durability import TIMEOUT_S, connect, declare, in_thread, wait_for
from tests.cluster.test_node_outcomes import brokers, held, modify, same_state
from tests.protocol.test_amqpsections import (
    APP_PROPERTIES,
    DATA_AB,
    DATA_CD,
    FOOTER,
    MESSAGE_ANN,
    PROPERTIES_LIST32,
    VALUE_NULL,
    section,
    string,
)

_TAGS = itertools.count(1)

TWO_DATA_SECTIONS = PROPERTIES_LIST32 + APP_PROPERTIES + DATA_AB + DATA_CD + FOOTER
NULL_BODY = MESSAGE_ANN + PROPERTIES_LIST32 + VALUE_NULL + FOOTER


def send_raw(conn: BlockingConnection, queue: str, payload: bytes) -> tuple[int, Any]:
    """Send ``payload`` as one transfer; (the outcome's state, its condition)."""
    sender = conn.create_sender(queue, name=f"raw-{next(_TAGS)}")
    delivery = sender.link.delivery(str(next(_TAGS)))
    sender.link.stream(payload)
    sender.link.advance()
    conn.wait(lambda: delivery.remote_state != 0, timeout=TIMEOUT_S, msg="the broker settles")
    return delivery.remote_state, delivery.remote.condition


class RawReceiver:
    """A Proton handler that keeps each transfer's payload as it came."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.deliveries: list[Delivery] = []

    def on_delivery(self, event: Event) -> None:
        dlv = event.delivery
        if dlv.readable and not dlv.partial:
            self.payloads.append(bytes(event.link.recv(dlv.pending)))
            event.link.advance()
            self.deliveries.append(dlv)


def receive_raw(port: int, queue: str, count: int) -> list[bytes]:
    conn = connect(port)
    try:
        raw = RawReceiver()
        # Held: a BlockingReceiver that is collected drops its link's handler.
        receiver = conn.create_receiver(queue, credit=count, handler=raw)
        conn.wait(lambda: len(raw.payloads) >= count, timeout=TIMEOUT_S, msg="messages arrive")
        for dlv in raw.deliveries:
            dlv.update(Delivery.ACCEPTED)
            dlv.settle()
        receiver.close()
        return raw.payloads
    finally:
        conn.close()


async def test_messages_arrive_at_another_broker_byte_for_byte() -> None:
    async with brokers(2) as [(one, port1), (two, port2)]:
        await in_thread(lambda: declare(port1, "q"))

        def publish() -> list[int]:
            conn = connect(port1)
            try:
                return [send_raw(conn, "q", m)[0] for m in (TWO_DATA_SECTIONS, NULL_BODY)]
            finally:
                conn.close()

        assert await in_thread(publish) == [Delivery.ACCEPTED, Delivery.ACCEPTED]
        await same_state([one, two])
        # What the site stores, and what the WAN copies to D (gateway/content.py).
        stored = [m.body for m in two.member.state.queues["q"].messages.values()]
        assert stored == [TWO_DATA_SECTIONS, NULL_BODY]
        received = await in_thread(lambda: receive_raw(port2, "q", 2))
        assert received == [TWO_DATA_SECTIONS, NULL_BODY]
        await wait_for(lambda: held(one, "q") == (0, 0))


async def test_a_redelivery_changes_the_header_and_annotations_only() -> None:
    async with brokers(2) as [(_one, port1), (_two, port2)]:
        await in_thread(lambda: declare(port1, "q"))

        def publish_then_fail_it() -> None:
            conn = connect(port1)
            try:
                send_raw(conn, "q", NULL_BODY)
                receiver = conn.create_receiver("q", credit=0)
                receiver.receive(timeout=TIMEOUT_S)
                modify(receiver, failed=True, annotations={"x-opt-seen": 1})
            finally:
                conn.close()

        await in_thread(publish_then_fail_it)
        (again,) = await in_thread(lambda: receive_raw(port2, "q", 1))
        sent, got = split_message_untrusted(NULL_BODY), split_message_untrusted(again)
        assert (got.bare, got.footer) == (sent.bare, sent.footer)
        assert header_delivery_count_untrusted(got.header) == 1
        decoded = Message()
        decoded.decode(again)
        assert decoded.annotations == {"a": "z", "x-opt-seen": 1}


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (DATA_AB + section(0x77, string("x")), "body sections of two kinds"),
        (DATA_AB[:-1], "runs past its end"),
        (FOOTER + DATA_AB, "out of order"),
    ],
    ids=["two-body-kinds", "cut-short", "footer-first"],
)
async def test_a_malformed_message_is_rejected_saying_why(payload: bytes, words: str) -> None:
    async with brokers(1) as [(one, port)]:
        await in_thread(lambda: declare(port, "q"))

        def publish() -> tuple[int, Any]:
            conn = connect(port)
            try:
                return send_raw(conn, "q", payload)
            finally:
                conn.close()

        state, condition = await in_thread(publish)
        assert state == Delivery.REJECTED
        assert condition.name == "amqp:decode-error"
        assert words in condition.description
        assert held(one, "q") == (0, 0)
