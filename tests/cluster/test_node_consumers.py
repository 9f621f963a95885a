"""A broker node's consumers (cluster/node.py): what a consumer leaves
unsettled comes back to the next one marked redelivered; browsers, JMS
selectors and temporary queues (dynamic nodes).

A real ``BrokerNode`` on the in-memory bus, Proton's blocking client in a
worker thread (the helpers of tests/cluster/test_node_durability.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from proton import Described, Disposition, Message, Terminus, Timeout, symbol
from proton.reactor import Copy, Filter, LinkOption, Selector
from proton.utils import LinkDetached

from cluster.addresses import Address
from cluster.bus import BusConfig
from cluster.node import BrokerConfig, BrokerNode
from cluster.siteview import describe
from cluster.state.model import TEMPORARY_ARG
from protocol import cluster as pc
from tests.cluster.test_amqp import RawClient
from tests.cluster.test_amqpauth import broker as memory_broker
from tests.cluster.test_node_durability import (
    TIMEOUT_S,
    connect,
    declare,
    in_thread,
    journaled_broker,
    send,
    wait_for,
)
from tests.support.membus import MemoryBus, open_memory_member


async def test_a_message_sent_to_a_consumer_that_leaves_unsettled_comes_back_marked_redelivered(
    tmp_path: Path,
) -> None:
    # Found by tests/chaos (seed 2024): a consumer closed while the bus held
    # up its accepts; what it never settled went to the next consumer with a
    # delivery count of 0, which could not tell it might be a duplicate.
    async with journaled_broker(tmp_path / "journal") as (_node, port, _gate):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: send(port, "q", "m", durable=False))

        def receive(*, accept: bool) -> tuple[str, int]:
            conn = connect(port)
            try:
                receiver = conn.create_receiver("q", credit=1)
                message = receiver.receive(timeout=TIMEOUT_S)
                if accept:
                    receiver.accept()
                return message.body, message.delivery_count
            finally:
                conn.close()

        assert await in_thread(lambda: receive(accept=False)) == ("m", 0)
        assert await in_thread(lambda: receive(accept=True)) == ("m", 1)


# ----------------------------------------------------------------------
# Browsing (distribution-mode copy): issue 24
# ----------------------------------------------------------------------


def publish(port: int, queue: str, *messages: Message) -> None:
    conn = connect(port)
    try:
        sender = conn.create_sender(queue)
        for message in messages:
            assert sender.send(message, error_states=[]).remote_state == Disposition.ACCEPTED
    finally:
        conn.close()


def take(port: int, queue: str, count: int, *options: Any) -> tuple[list[Any], int]:
    """Receive ``count`` bodies from ``queue`` and accept each; also the
    distribution mode the broker's attach answered with."""
    conn = connect(port)
    try:
        receiver = conn.create_receiver(queue, credit=count, options=list(options) or None)
        bodies = []
        for _ in range(count):
            bodies.append(receiver.receive(timeout=TIMEOUT_S).body)
            receiver.accept()
        return bodies, receiver.link.remote_source.distribution_mode
    finally:
        conn.close()


def nothing_more(port: int, queue: str, *options: Any) -> bool:
    """True when a receiver on ``queue`` gets nothing within a short wait
    (the broker had the message to give at once, if any)."""
    conn = connect(port)
    try:
        receiver = conn.create_receiver(queue, credit=1, options=list(options) or None)
        try:
            receiver.receive(timeout=0.5)
        except Timeout:
            return True
        return False
    finally:
        conn.close()


def depth(node: BrokerNode, queue: str) -> tuple[int, int]:
    q = node.member.state.queues[queue]
    return q.depth, len(q.acquired)


async def test_a_browsing_receiver_sees_every_message_and_takes_none() -> None:
    async with memory_broker() as (node, port):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: publish(port, "q", *(Message(body=f"m{i}") for i in range(3))))

        bodies, mode = await in_thread(lambda: take(port, "q", 3, Copy()))
        assert (bodies, mode) == (["m0", "m1", "m2"], Terminus.DIST_MODE_COPY)
        # Accepting a browsed message changes nothing in the queue.
        await wait_for(lambda: depth(node, "q") == (3, 0))
        assert await in_thread(lambda: nothing_more(port, "q", Copy())) is False

        bodies, mode = await in_thread(lambda: take(port, "q", 3))
        assert (bodies, mode) == (["m0", "m1", "m2"], Terminus.DIST_MODE_MOVE)
        await wait_for(lambda: depth(node, "q") == (0, 0))


async def test_a_browser_sees_messages_published_after_it_attached_and_each_once() -> None:
    async with memory_broker() as (node, port):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: publish(port, "q", Message(body="before")))

        def browse_while_publishing() -> list[Any]:
            conn = connect(port)
            try:
                receiver = conn.create_receiver("q", credit=10, options=Copy())
                seen = [receiver.receive(timeout=TIMEOUT_S).body]
                receiver.accept()
                publish(port, "q", Message(body="after"))
                seen.append(receiver.receive(timeout=TIMEOUT_S).body)
                receiver.accept()
                with contextlib.suppress(Timeout):
                    seen.append(receiver.receive(timeout=0.5).body)
                return seen
            finally:
                conn.close()

        assert await in_thread(browse_while_publishing) == ["before", "after"]
        await wait_for(lambda: depth(node, "q") == (2, 0))


async def test_a_browser_sees_messages_another_consumer_holds_unsettled() -> None:
    async with memory_broker() as (node, port):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: publish(port, "q", Message(body="m")))

        def hold_then_browse() -> tuple[Any, Any]:
            conn = connect(port)
            try:
                holder = conn.create_receiver("q", credit=1)
                held = holder.receive(timeout=TIMEOUT_S).body
                browsed, _ = take(port, "q", 1, Copy())
                return held, browsed
            finally:
                conn.close()

        assert await in_thread(hold_then_browse) == ("m", ["m"])
        # The holder left without settling: the message is back, untouched.
        await wait_for(lambda: depth(node, "q") == (1, 0))


# ----------------------------------------------------------------------
# JMS selectors (source filter): issue 24
# ----------------------------------------------------------------------

COLORS = ("red", "blue", "red", "green", "blue", "red")


def colored(*colors: str) -> list[Message]:
    return [Message(body=f"{c}-{i}", properties={"color": c}) for i, c in enumerate(colors)]


def refusal(port: int, queue: str, *options: Any) -> str:
    """The condition and description of the detach that refuses a
    receiver's attach."""
    conn = connect(port)
    try:
        with pytest.raises(LinkDetached) as refused:
            conn.create_receiver(queue, options=list(options))
        condition = refused.value.link.remote_condition
        return f"{condition.name}: {condition.description}"
    finally:
        conn.close()


async def test_a_selector_consumer_gets_only_matching_messages_and_leaves_the_others() -> None:
    async with memory_broker() as (node, port):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: publish(port, "q", *colored(*COLORS)))

        def select() -> tuple[list[Any], Any]:
            conn = connect(port)
            try:
                receiver = conn.create_receiver("q", credit=10, options=Selector("color = 'red'"))
                bodies = []
                for _ in range(3):
                    bodies.append(receiver.receive(timeout=TIMEOUT_S).body)
                    receiver.accept()
                with contextlib.suppress(Timeout):
                    bodies.append(receiver.receive(timeout=0.5).body)
                answered = receiver.link.remote_source.filter
                answered.rewind()
                answered.next()
                return bodies, answered.get_object()
            finally:
                conn.close()

        bodies, answered = await in_thread(select)
        assert bodies == ["red-0", "red-2", "red-5"]
        # The attach answers with the filter: it is applied.
        assert answered[symbol("selector")].value == "color = 'red'"
        # The others stayed, in order, for a consumer without a selector.
        assert await in_thread(lambda: take(port, "q", 3)) == (
            ["blue-1", "green-3", "blue-4"],
            Terminus.DIST_MODE_MOVE,
        )
        await wait_for(lambda: depth(node, "q") == (0, 0))


async def test_a_selector_consumer_gets_a_matching_message_published_after_it_waited() -> None:
    async with memory_broker() as (_node, port):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: publish(port, "q", *colored("blue")))

        def wait_then_receive() -> Any:
            conn = connect(port)
            try:
                receiver = conn.create_receiver(
                    "q", credit=1, options=Selector("color IN ('red', 'green')")
                )
                publish(port, "q", *colored("blue", "green"))
                body = receiver.receive(timeout=TIMEOUT_S).body
                receiver.accept()
                return body
            finally:
                conn.close()

        assert await in_thread(wait_then_receive) == "green-1"


async def test_a_selector_consumer_gets_a_released_message_again_after_it_passed_over_it() -> None:
    # While red-0 is held, blue-1 makes the consumer's broker look at the
    # queue and find nothing to select up to blue-1; the release of red-0
    # must make it look again.
    async with memory_broker() as (_node, port):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: publish(port, "q", *colored("red")))

        def hold_release_receive() -> list[tuple[Any, int]]:
            conn = connect(port)
            try:
                receiver = conn.create_receiver("q", credit=2, options=Selector("color = 'red'"))
                first = receiver.receive(timeout=TIMEOUT_S)
                publish(port, "q", Message(body="blue-1", properties={"color": "blue"}))
                receiver.release(delivered=False)
                again = receiver.receive(timeout=TIMEOUT_S)
                receiver.accept()
                return [(first.body, first.delivery_count), (again.body, again.delivery_count)]
            finally:
                conn.close()

        assert await in_thread(hold_release_receive) == [("red-0", 0), ("red-0", 0)]


async def test_a_browser_with_a_selector_sees_only_matching_messages() -> None:
    async with memory_broker() as (node, port):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: publish(port, "q", *colored(*COLORS)))
        bodies, _ = await in_thread(
            lambda: take(port, "q", 2, Copy(), Selector("color <> 'red' AND color LIKE 'b%'"))
        )
        assert bodies == ["blue-1", "blue-4"]
        await wait_for(lambda: depth(node, "q") == (6, 0))


async def test_a_malformed_selector_is_refused_at_attach_naming_it_and_the_position() -> None:
    async with memory_broker() as (_node, port):
        await in_thread(lambda: declare(port, "q"))
        text = await in_thread(lambda: refusal(port, "q", Selector("color = 'red' AND")))
        assert "amqp:invalid-field" in text
        assert "selector \"color = 'red' AND\": at position 18: expected a value" in text


async def test_a_filter_the_broker_does_not_apply_is_refused_naming_it() -> None:
    async with memory_broker() as (node, port):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: publish(port, "q", *colored("red")))
        no_local = Filter(
            {symbol("no-local"): Described(symbol("apache.org:no-local-filter:list"), [])}
        )
        text = await in_thread(lambda: refusal(port, "q", no_local))
        assert "amqp:not-implemented" in text
        assert "source filter 'no-local' (descriptor 'apache.org:no-local-filter:list')" in text
        assert "attach without it" in text
        await wait_for(lambda: depth(node, "q") == (1, 0))


# ----------------------------------------------------------------------
# Dynamic nodes: temporary queues (issue 24)
# ----------------------------------------------------------------------


class DynamicTarget(LinkOption):
    """Ask for a dynamic target: the broker names a new node."""

    def apply(self, link: Any) -> None:
        link.target.dynamic = True


def temporaries(node: BrokerNode) -> list[str]:
    return [name for name, q in node.member.state.queues.items() if TEMPORARY_ARG in q.args]


async def test_a_dynamic_source_is_a_temporary_queue_that_goes_with_its_link() -> None:
    async with memory_broker() as (node, port):

        def request_reply() -> tuple[str, Any]:
            conn = connect(port)
            try:
                replies = conn.create_receiver(None, credit=1, dynamic=True)
                address = replies.link.remote_source.address
                publish(port, address, Message(body="the reply"))
                body = replies.receive(timeout=TIMEOUT_S).body
                replies.accept()
                replies.close()
                return address, body
            finally:
                conn.close()

        address, body = await in_thread(request_reply)
        assert address.startswith("$drgate.temp.")
        assert body == "the reply"
        await wait_for(lambda: temporaries(node) == [])
        assert address not in node.member.state.queues


async def test_a_dynamic_target_is_a_temporary_queue_that_goes_with_its_link() -> None:
    async with memory_broker() as (node, port):

        def send_then_read() -> tuple[str, list[str], Any]:
            conn = connect(port)
            try:
                sender = conn.create_sender(None, options=DynamicTarget())
                address = sender.link.remote_target.address
                sender.send(Message(body="to the node"))
                during = temporaries(node)
                bodies, _ = take(port, address, 1)
                sender.close()
                return address, during, bodies
            finally:
                conn.close()

        address, during, bodies = await in_thread(send_then_read)
        assert address.startswith("$drgate.temp.")
        assert (during, bodies) == ([address], ["to the node"])
        await wait_for(lambda: temporaries(node) == [])


async def test_a_temporary_queue_goes_when_its_client_vanishes() -> None:
    async with memory_broker() as (node, port):
        client = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
        client.conn.open()
        session = client.conn.session()
        session.open()
        receiver = session.receiver("replies")
        receiver.source.dynamic = True
        receiver.open()
        await client.pump_until(lambda: bool(receiver.remote_source.address))
        address = receiver.remote_source.address
        assert temporaries(node) == [address]
        client.abort()  # no detach, no close: a TCP reset
        await wait_for(lambda: temporaries(node) == [])


# ----------------------------------------------------------------------
# Two brokers of one site: the state decides, the same at both
# ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def two_brokers() -> AsyncIterator[tuple[list[BrokerNode], list[int]]]:
    """Brokers 1 and 2 of one site on one in-memory bus, both serving."""
    hub = MemoryBus()
    nodes = [
        BrokerNode(
            BrokerConfig(
                cluster="site-p",
                node=n,
                bus=BusConfig(backend="embedded", group="site-p", node=n),
                amqp=Address("127.0.0.1", 0),
            ),
            open_member=open_memory_member(hub),
        )
        for n in (1, 2)
    ]
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            ports = [await nursery.start(node.serve) for node in nodes]
            await wait_for(lambda: all(len(n.member.state.ready) == 2 for n in nodes))
            yield nodes, ports
            nursery.cancel_scope.cancel()


async def test_selector_browse_and_temporary_queues_agree_across_two_brokers() -> None:
    async with two_brokers() as (nodes, (port1, port2)):
        await in_thread(lambda: declare(port1, "q"))
        await in_thread(lambda: publish(port1, "q", *colored(*COLORS)))
        # A browser on broker 2 sees all six; nothing is taken.
        bodies, _ = await in_thread(lambda: take(port2, "q", 6, Copy()))
        assert bodies == [f"{c}-{i}" for i, c in enumerate(COLORS)]
        # The selector consumer on broker 2 and a plain one on broker 1 split
        # the queue exactly.
        reds, _ = await in_thread(lambda: take(port2, "q", 3, Selector("color = 'red'")))
        others, _ = await in_thread(lambda: take(port1, "q", 3))
        assert (reds, others) == (["red-0", "red-2", "red-5"], ["blue-1", "green-3", "blue-4"])
        await wait_for(lambda: all(depth(n, "q") == (0, 0) for n in nodes))

        # A temporary queue made at broker 1 is served by broker 2, and goes
        # at both when its link closes.
        def request_reply() -> tuple[str, list[str], Any]:
            conn = connect(port1)
            try:
                replies = conn.create_receiver(None, credit=1, dynamic=True)
                address = replies.link.remote_source.address
                publish(port2, address, Message(body="reply"))
                at_two = temporaries(nodes[1])
                body = replies.receive(timeout=TIMEOUT_S).body
                replies.accept()
                replies.close()
                return address, at_two, body
            finally:
                conn.close()

        address, at_two, body = await in_thread(request_reply)
        assert (at_two, body) == ([address], "reply")
        await wait_for(lambda: all(temporaries(n) == [] for n in nodes))
        assert nodes[0].member.state.cseq == nodes[1].member.state.cseq
        assert (
            describe(nodes[0].member.state)["digest"] == describe(nodes[1].member.state)["digest"]
        )


# ----------------------------------------------------------------------
# Standing demand (cluster/state/demand.py): issue 18
# ----------------------------------------------------------------------


def waiting(node: BrokerNode, queue: str) -> int:
    return sum(node.member.state.queues[queue].waiting.values())


async def test_a_waiting_consumer_gets_a_new_message_without_an_acquire_of_its_broker() -> None:
    async with two_brokers() as (nodes, (port1, port2)):
        await in_thread(lambda: declare(port1, "q"))
        posted: list[object] = []
        post = nodes[1].member.post

        def recording(cmd: Any) -> None:
            posted.append(cmd)
            post(cmd)

        nodes[1].member.post = recording  # type: ignore[method-assign]
        client, receiver = await raw_consumer(port2, 4)  # its credit, once
        # Its credit is the site's standing demand before anything arrives.
        await wait_for(lambda: all(waiting(n, "q") == 4 for n in nodes))
        asked = len(posted)
        await in_thread(lambda: publish(port1, "q", Message(body="a"), Message(body="b")))
        await client.pump_until(lambda: receiver.queued == 2)
        bodies = []
        while receiver.current is not None:
            message = Message()
            message.decode(receiver.recv(receiver.current.pending))
            bodies.append(message.body)
            receiver.advance()
        assert bodies == ["a", "b"]
        # The publishes at broker 1 delivered them at broker 2: it asked nothing more.
        assert not [c for c in posted[asked:] if isinstance(c, pc.Acquire)]
        assert all(waiting(n, "q") == 2 for n in nodes)
        # Its link closes: what it still asked for is withdrawn at every member.
        receiver.close()
        await client.pump_until(lambda: receiver.state & receiver.REMOTE_CLOSED)
        await wait_for(lambda: all(waiting(n, "q") == 0 for n in nodes))
        await in_thread(lambda: publish(port1, "q", Message(body="c")))
        # a and b came back unsettled; c stays for the next consumer.
        await wait_for(lambda: all(depth(n, "q") == (3, 0) for n in nodes))
        client.abort()


async def raw_consumer(port: int, credit: int, name: str = "consumer") -> tuple[RawClient, Any]:
    """A raw Proton client attached to queue "q" with ``credit`` (the broker
    has answered the attach), and its receiver."""
    client = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
    client.conn.open()
    session = client.conn.session()
    session.open()
    receiver = session.receiver(name)
    receiver.source.address = "q"
    receiver.open()
    receiver.flow(credit)
    await client.pump_until(lambda: receiver.state & receiver.REMOTE_ACTIVE)
    return client, receiver


async def test_a_drained_consumer_withdraws_its_standing_demand() -> None:
    async with memory_broker() as (node, port):
        await in_thread(lambda: declare(port, "q"))
        client, receiver = await raw_consumer(port, 5)
        await wait_for(lambda: waiting(node, "q") == 5)
        receiver.drain(0)  # take what is there (nothing), then no more
        await client.pump_until(lambda: receiver.credit == 0 and not receiver.draining())
        await wait_for(lambda: waiting(node, "q") == 0)
        await in_thread(lambda: publish(port, "q", Message(body="later")))
        await wait_for(lambda: depth(node, "q") == (1, 0))  # nobody took it
        client.abort()


async def test_a_drain_posts_its_withdraw_once_while_it_is_on_its_way() -> None:
    async with memory_broker() as (node, port):
        await in_thread(lambda: declare(port, "q"))
        client, receiver = await raw_consumer(port, 5)
        await wait_for(lambda: waiting(node, "q") == 5)
        held: list[Any] = []  # the Withdraws, kept from the bus until the end
        post = node.member.post
        node.member.post = lambda c: held.append(c) if isinstance(c, pc.Withdraw) else post(c)
        receiver.drain(0)
        await client.flush()
        await wait_for(lambda: len(held) == 1)
        (consumer,) = node._consumers.values()
        await node.on_credit(consumer.link, 0)  # the next flow frame, before it applies
        await node.on_credit(consumer.link, 0)
        assert len(held) == 1
        node.member.post = post
        post(held[0])
        await wait_for(lambda: waiting(node, "q") == 0)
        client.abort()


async def test_a_waiting_consumer_of_a_queue_a_switchover_closed_is_detached_naming_it() -> None:
    async with memory_broker() as (node, port):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: publish(port, "q", Message(body="m")))
        holder, held = await raw_consumer(port, 1, "holder")
        await holder.pump_until(lambda: held.current is not None)  # it holds "m"
        waiter, waits = await raw_consumer(port, 1, "waiter")
        await wait_for(lambda: waiting(node, "q") == 1)
        quiesce = pc.Switchover("site-d", pc.SwitchoverPhase.QUIESCE, 1, {"q": None})
        await node.member.submit_and_wait(quiesce)
        holder.abort()  # "m" comes back while the queue is closed to consumers
        await waiter.pump_until(lambda: waits.remote_condition is not None)
        assert "switchover" in waits.remote_condition.description
        await wait_for(lambda: waiting(node, "q") == 0 and depth(node, "q") == (1, 0))
        waiter.abort()


async def test_a_consumer_s_top_up_held_back_by_what_it_held_is_asked_once_it_settles() -> None:
    async with memory_broker() as (_node, port):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: publish(port, "q", *(Message(body=f"m{i}") for i in range(30))))
        client, receiver = await raw_consumer(port, 10)
        await client.pump_until(lambda: receiver.queued == 10)
        receiver.flow(5)  # five more while it holds ten: the broker waits for half a window
        held = []
        while receiver.current is not None:
            held.append(receiver.current)
            receiver.advance()
        for delivery in held:
            delivery.update(Disposition.ACCEPTED)
            delivery.settle()
        # Settled, nothing holds the five back: they come, with no new publish.
        await client.pump_until(lambda: receiver.queued == 5)
        client.abort()
