"""Declaring a queue on attach (docs/broker.md, "Declaring a queue on attach,
with replication arguments"): the ``create-on-demand`` capability with the
declare arguments as dynamic-node-properties creates the queue with them at
every broker; bad arguments refuse the attach with ``amqp:invalid-field`` and
the text docs/broker.md's "Errors clients see" table gives, and create nothing.

Real ``BrokerNode`` instances on one in-memory bus, Proton's blocking client
in a worker thread."""

from __future__ import annotations

from typing import Any

import pytest
from proton import Message
from proton.reactor import DynamicNodeProperties, LinkOption
from proton.utils import LinkDetached

from cluster.siteview import has_queue
from tests.cluster.test_node_durability import connect, in_thread
from tests.cluster.test_node_outcomes import brokers, same_state


class CreateOnDemand(LinkOption):
    """The docs' example option: ask the broker to create the node."""

    def apply(self, link: Any) -> None:
        terminus = link.source if link.is_receiver else link.target
        terminus.capabilities.put_symbol("create-on-demand")


def attach_sender(port: int, queue: str, properties: dict[str, Any]) -> None:
    conn = connect(port)
    try:
        sender = conn.create_sender(
            queue, options=[CreateOnDemand(), DynamicNodeProperties(properties)]
        )
        sender.send(Message(body="first order"))
    finally:
        conn.close()


async def test_create_on_demand_declares_the_queue_with_its_arguments_at_every_broker() -> None:
    async with brokers(2) as started:
        (first, port), (second, _) = started
        props = {"qpid.replicate": "all", "qpid.queue_event_generation": 2}
        await in_thread(lambda: attach_sender(port, "orders", props))
        await same_state([first, second])
        queue = second.member.state.queues["orders"]
        assert queue.args["qpid.replicate"] == "all"
        assert queue.args["qpid.queue_event_generation"] == 2
        assert len(queue.messages) == 1


async def test_create_on_demand_with_a_bad_argument_is_refused_with_the_documented_text() -> None:
    async with brokers(1) as started:
        ((node, port),) = started
        props = {"qpid.replicate": "some"}
        with pytest.raises(LinkDetached) as refused:
            await in_thread(lambda: attach_sender(port, "q", props))
        assert refused.value.condition == "amqp:invalid-field", str(refused.value)
        assert str(refused.value).endswith(
            "Condition('amqp:invalid-field', \"cannot declare queue 'q': "
            "qpid.replicate='some' is not one of all, configuration, none\")"
        )
        assert not has_queue(node.member.state, "q")
