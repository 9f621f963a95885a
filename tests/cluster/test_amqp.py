"""cluster.amqp against Proton's own Python client and a raw engine client.

The node is replaced by ``MemoryHandler``: a dict of lists as queues.  Blocking
clients run in threads (``trio.to_thread.run_sync``) against the trio server
on 127.0.0.1 port 0; the tests wait on conditions, never on sleeps.
"""

from __future__ import annotations

import functools
import socket
import ssl
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import proton
import pytest
import trio
import trustme
from proton import ConnectionException, Message, SSLDomain
from proton.handlers import MessagingHandler
from proton.reactor import AtMostOnce, Container, DynamicNodeProperties, LinkOption
from proton.utils import BlockingConnection, LinkDetached, SendException

from cluster import amqp, amqpserver

pytestmark = pytest.mark.integration

TIMEOUT_S = 20  # per test; real runs take well under a second each
CLIENT_TIMEOUT_S = 10  # BlockingConnection's own wait limit


class MemoryHandler:
    """A toy node: queues are lists, consumers get messages while they have credit."""

    def __init__(self, *, settle_now: bool = True, initial_credit: int = 50) -> None:
        self.settle_now = settle_now
        self.initial_credit = initial_credit
        self.queues: dict[str, list[Any]] = defaultdict(list)
        self.consumers: dict[str, list[amqp.OutgoingLink]] = defaultdict(list)
        self.pending: list[amqp.InboundDelivery] = []
        self.outcomes: list[tuple[object, amqp.Outcome]] = []
        self.batches: list[int] = []  # settlements per on_outcomes call
        self.attached: list[amqp.OutgoingLink | amqp.IncomingLink] = []
        self.closed_links: list[tuple[amqp.OutgoingLink | amqp.IncomingLink, list[object]]] = []
        self.closed_conns: list[amqp.AmqpConnection] = []
        self.refuse: dict[str, tuple[str, str]] = {}
        self.fail_on_attach: set[str] = set()
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def _dispatch(self, address: str) -> None:
        queue = self.queues[address]
        for link in self.consumers[address]:
            while queue and link.credit > 0:
                body = queue.pop(0)
                link.send_nowait(Message(body=body), token=(address, body))

    async def on_sender_link(self, link: amqp.OutgoingLink) -> None:
        self.attached.append(link)
        assert link.address is not None
        if link.address in self.refuse:
            link.close(*self.refuse[link.address])
        else:
            self.consumers[link.address].append(link)
        self._notify()

    async def on_receiver_link(self, link: amqp.IncomingLink) -> None:
        self.attached.append(link)
        assert link.address is not None
        if link.address in self.fail_on_attach:
            raise RuntimeError("node bug")
        if link.address in self.refuse:
            link.close(*self.refuse[link.address])
        else:
            link.flow(self.initial_credit)
        self._notify()

    async def on_message(self, link: amqp.IncomingLink, delivery: amqp.InboundDelivery) -> None:
        assert link.address is not None
        if self.settle_now:
            self.queues[link.address].append(delivery.message.body)
            delivery.settle(amqp.ACCEPTED)
            link.flow(1)
            self._dispatch(link.address)
        else:
            self.pending.append(delivery)
        self._notify()

    async def on_credit(self, link: amqp.OutgoingLink, credit: int) -> None:
        assert link.address is not None
        self._dispatch(link.address)
        self._notify()

    async def on_outcomes(
        self, link: amqp.OutgoingLink, outcomes: Sequence[tuple[object, amqp.Outcome]]
    ) -> None:
        self.outcomes += outcomes
        self.batches.append(len(outcomes))
        self._notify()

    async def on_close_asked(self, conn: amqp.AmqpConnection) -> None:
        pass

    async def on_link_closed(self, link: amqp.OutgoingLink | amqp.IncomingLink) -> None:
        if isinstance(link, amqp.OutgoingLink) and link.address is not None:
            consumers = self.consumers[link.address]
            if link in consumers:
                consumers.remove(link)
            tokens = link.unsettled_tokens()
        else:
            tokens = []
        self.closed_links.append((link, tokens))
        self._notify()

    async def on_connection_closed(self, conn: amqp.AmqpConnection) -> None:
        self.closed_conns.append(conn)
        self._notify()


async def start_server(nursery: trio.Nursery, handler: MemoryHandler, **kwargs: Any) -> int:
    port: int = await nursery.start(
        functools.partial(amqpserver.serve_amqp, handler, "127.0.0.1", 0, **kwargs)
    )
    return port


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


class LinkProperties(LinkOption):
    """Sets link properties on a client link (the form docs/broker.md shows)."""

    def __init__(self, props: dict[str, Any]) -> None:
        self.props = props

    def apply(self, link: proton.Link) -> None:
        link.properties = {proton.symbol(k): v for k, v in self.props.items()}


class Capabilities(LinkOption):
    """Sets terminus capabilities (source for receivers, target for senders)."""

    def __init__(self, *caps: str) -> None:
        self.caps = caps

    def apply(self, link: proton.Link) -> None:
        terminus = link.source if link.is_receiver else link.target
        if len(self.caps) == 1:  # AMQP "multiple": one value may stand alone
            terminus.capabilities.put_symbol(self.caps[0])
        else:
            terminus.capabilities.put_object([proton.symbol(c) for c in self.caps])


# ---------------------------------------------------------------------------
# Proton's BlockingConnection
# ---------------------------------------------------------------------------


async def test_send_n_then_receive_them_with_credit() -> None:
    n = 100
    handler = MemoryHandler()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)

            def client() -> list[Any]:
                conn = BlockingConnection(f"127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S)
                sender = conn.create_sender(
                    "orders",
                    options=[
                        DynamicNodeProperties({"qpid.replicate": "all"}),
                        Capabilities("create-on-demand"),
                        LinkProperties({"qpid.queue_event_generation": 2}),
                    ],
                )
                for i in range(n):
                    sender.send(Message(body=f"m{i}"))
                receiver = conn.create_receiver("orders", credit=40)
                got = []
                for _ in range(n):
                    got.append(receiver.receive(timeout=CLIENT_TIMEOUT_S).body)
                    receiver.accept()
                conn.close()
                return got

            got = await in_thread(client)
            assert got == [f"m{i}" for i in range(n)]
            await handler.wait_for(
                lambda: len(handler.outcomes) == n and bool(handler.closed_conns)
            )
            assert [o for _, o in handler.outcomes] == [amqp.ACCEPTED] * n
            assert handler.queues["orders"] == []
            incoming = handler.attached[0]
            assert isinstance(incoming, amqp.IncomingLink)
            assert incoming.node_properties == {"qpid.replicate": "all"}
            assert incoming.properties == {"qpid.queue_event_generation": 2}
            assert incoming.create_on_demand
            assert incoming.declare_arguments() == {
                "qpid.replicate": "all",
                "qpid.queue_event_generation": 2,
            }
            # Both links were reported closed, each once, then the connection once.
            assert sorted(type(link).__name__ for link, _ in handler.closed_links) == [
                "IncomingLink",
                "OutgoingLink",
            ]
            assert len(handler.closed_conns) == 1
            nursery.cancel_scope.cancel()


async def test_settle_later_holds_the_client_until_the_node_settles() -> None:
    handler = MemoryHandler(settle_now=False)
    results: list[object] = []
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)

            def client() -> None:
                conn = BlockingConnection(f"127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S)
                sender = conn.create_sender("q")
                sender.send(Message(body="one"))
                results.append("one settled")
                try:
                    sender.send(Message(body="two"))
                except SendException as exc:
                    results.append(exc.state)
                conn.close()

            client_done = trio.Event()

            async def run_client() -> None:
                await in_thread(client)
                client_done.set()

            nursery.start_soon(run_client)
            await handler.wait_for(lambda: len(handler.pending) == 1)
            # The publish is not settled yet, so the client is still blocked.
            assert results == []
            handler.pending[0].settle(amqp.ACCEPTED)
            await handler.wait_for(lambda: len(handler.pending) == 2)
            assert results == ["one settled"]
            handler.pending[1].settle(
                amqp.Rejected("amqp:resource-limit-exceeded", "queue q is full")
            )
            handler.pending[1].settle(amqp.ACCEPTED)  # idempotent: the first outcome stands
            await client_done.wait()
            assert results == ["one settled", proton.Delivery.REJECTED]
            assert handler.pending[0].message.body == "one"
            nursery.cancel_scope.cancel()


async def test_refused_attach_reaches_client_with_condition_and_description() -> None:
    handler = MemoryHandler()
    handler.refuse["ghost"] = ("amqp:not-found", "queue 'ghost' does not exist on node 1")
    handler.refuse["replica"] = (
        "amqp:unauthorized-access",
        "queue 'replica' is a read-only full replica; promote the site to write",
    )
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)

            def client() -> list[str]:
                conn = BlockingConnection(f"127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S)
                texts = []
                with pytest.raises(LinkDetached) as refused_send:
                    conn.create_sender("ghost")
                texts.append(str(refused_send.value))
                with pytest.raises(LinkDetached) as refused_recv:
                    conn.create_receiver("replica")
                texts.append(str(refused_recv.value))
                # The connection survives a refused attach.
                conn.create_sender("fine").send(Message(body="ok"))
                conn.close()
                return texts

            texts = await in_thread(client)
            assert "amqp:not-found" in texts[0]
            assert "queue 'ghost' does not exist on node 1" in texts[0]
            assert "amqp:unauthorized-access" in texts[1]
            assert "read-only full replica" in texts[1]
            assert handler.queues["fine"] == ["ok"]
            await handler.wait_for(lambda: bool(handler.closed_conns))
            closed = [link.address for link, _ in handler.closed_links]
            assert closed.count("ghost") == 1
            assert closed.count("replica") == 1
            nursery.cancel_scope.cancel()


async def test_client_outcomes_reach_the_handler() -> None:
    handler = MemoryHandler()
    handler.queues["q"] = ["a", "b", "c", "d"]
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)

            def client() -> None:
                conn = BlockingConnection(f"127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S)
                receiver = conn.create_receiver("q", credit=4)
                receiver.receive(timeout=CLIENT_TIMEOUT_S)
                receiver.reject()
                receiver.receive(timeout=CLIENT_TIMEOUT_S)
                receiver.release(delivered=False)
                receiver.receive(timeout=CLIENT_TIMEOUT_S)
                receiver.release(delivered=True)
                receiver.receive(timeout=CLIENT_TIMEOUT_S)
                receiver.accept()
                conn.close()

            await in_thread(client)
            await handler.wait_for(lambda: len(handler.outcomes) == 4)
            outcomes = dict(handler.outcomes)
            assert isinstance(outcomes[("q", "a")], amqp.Rejected)
            assert outcomes[("q", "b")] == amqp.RELEASED
            # BlockingReceiver.release(delivered=True) sends modified without flags;
            # the flags themselves are checked with the raw client below.
            assert outcomes[("q", "c")] == amqp.Modified()
            assert outcomes[("q", "d")] == amqp.ACCEPTED
            nursery.cancel_scope.cancel()


async def test_settlements_that_arrive_together_reach_the_handler_together() -> None:
    # The node turns each call into one bus command: a consumer's window of
    # accepts should be one Accept, not one per message.
    n = 20
    handler = MemoryHandler()
    handler.queues["q"] = [f"m{i}" for i in range(n)]
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)

            class AcceptAllAtOnce(MessagingHandler):  # type: ignore[misc]
                def __init__(self) -> None:
                    super().__init__(prefetch=n, auto_accept=False)
                    self.held: list[proton.Delivery] = []

                def on_start(self, event: proton.Event) -> None:
                    conn = event.container.connect(f"127.0.0.1:{port}", reconnect=False)
                    event.container.create_receiver(conn, "q")

                def on_message(self, event: proton.Event) -> None:
                    self.held.append(event.delivery)
                    if len(self.held) == n:
                        for delivery in self.held:  # one write carries them all
                            self.accept(delivery)
                        event.connection.close()

            await in_thread(lambda: Container(AcceptAllAtOnce()).run())
            await handler.wait_for(lambda: len(handler.outcomes) == n)
            assert [o for _, o in handler.outcomes] == [amqp.ACCEPTED] * n
            assert [t for t, _ in handler.outcomes] == [("q", f"m{i}") for i in range(n)]
            assert max(handler.batches) > 1, handler.batches
            nursery.cancel_scope.cancel()


async def test_an_idle_connection_does_not_spin() -> None:
    # The pump kicked the writer after each pass and the writer woke the
    # pump back even with nothing written: an idle consumer kept a broker's
    # core busy (found profiling the D broker's delivery path).
    handler = MemoryHandler()
    handler.queues["q"] = []
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)
            conn = await in_thread(
                lambda: BlockingConnection(f"127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S)
            )
            try:
                await in_thread(lambda: conn.create_receiver("q", credit=10))
                await handler.wait_for(lambda: bool(handler.consumers["q"]))
                link = handler.consumers["q"][0]
                before = link.connection.statistics_pump_cycles
                await trio.sleep(0.5)  # an observation window, not a wait for anything
                cycles = link.connection.statistics_pump_cycles - before
                # The timer loop wakes the pump now and then; a spin is thousands.
                assert cycles < 50, f"{cycles} pump passes in 0.5 s on an idle connection"
            finally:
                await in_thread(conn.close)
            nursery.cancel_scope.cancel()


async def test_a_publish_settled_from_another_task_costs_one_pump_pass() -> None:
    # A settlement made outside the pump leaves a PN_TRANSPORT event, and the
    # writer woke the pump for it after writing: two passes per publish where
    # the broker node (which settles once the bus has applied) needs one.
    handler = MemoryHandler(settle_now=False)
    n = 40
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)

            async def settle_as_they_come() -> None:
                while True:
                    await handler.wait_for(lambda: bool(handler.pending))
                    delivery = handler.pending.pop(0)
                    delivery.settle(amqp.ACCEPTED)
                    delivery.link.flow(1)

            nursery.start_soon(settle_as_they_come)

            def client() -> None:
                conn = BlockingConnection(f"127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S)
                sender = conn.create_sender("q")
                for i in range(n):
                    sender.send(Message(body=f"m{i}"))  # waits for its settlement
                conn.close()

            await in_thread(client)
            (link,) = handler.attached
            cycles = link.connection.statistics_pump_cycles
            # Opening, attaching and closing take a few passes more.
            assert cycles < n + 10, f"{cycles} pump passes for {n} publishes"
            nursery.cancel_scope.cancel()


async def test_presettled_receiver_gets_accepted_outcomes_at_send() -> None:
    handler = MemoryHandler()
    handler.queues["q"] = ["x", "y"]
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)

            def client() -> list[Any]:
                conn = BlockingConnection(f"127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S)
                receiver = conn.create_receiver("q", credit=2, options=AtMostOnce())
                got = [receiver.receive(timeout=CLIENT_TIMEOUT_S).body for _ in range(2)]
                conn.close()
                return got

            assert await in_thread(client) == ["x", "y"]
            await handler.wait_for(lambda: len(handler.outcomes) == 2)
            assert handler.outcomes == [(("q", "x"), amqp.ACCEPTED), (("q", "y"), amqp.ACCEPTED)]
            nursery.cancel_scope.cancel()


async def test_handler_failure_closes_only_that_connection() -> None:
    handler = MemoryHandler()
    handler.fail_on_attach.add("boom")
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)

            def bad_client() -> str:
                conn = BlockingConnection(f"127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S)
                with pytest.raises((ConnectionException, LinkDetached)) as failed:
                    conn.create_sender("boom")
                return str(failed.value)

            def good_client() -> None:
                conn = BlockingConnection(f"127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S)
                conn.create_sender("fine").send(Message(body="ok"))
                conn.close()

            assert "amqp:internal-error" in await in_thread(bad_client)
            await in_thread(good_client)
            assert handler.queues["fine"] == ["ok"]
            await handler.wait_for(lambda: len(handler.closed_conns) == 2)
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------
# A raw client: Proton's engine in client mode over a trio socket, so a test
# can stop talking or cut the socket at an exact point.
# ---------------------------------------------------------------------------


class RawClient:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.transport = proton.Transport()
        self.transport.sasl().allowed_mechs("ANONYMOUS")
        self.conn = proton.Connection()
        self.collector = proton.Collector()
        self.conn.collect(self.collector)
        self.transport.bind(self.conn)
        self.eof = False

    async def flush(self) -> None:
        while (pending := self.transport.pending()) > 0:
            data = self.transport.peek(pending)
            assert data is not None
            await self.stream.send_all(data)
            self.transport.pop(len(data))

    async def pump_until(self, predicate: Callable[[], bool]) -> None:
        while True:
            await self.flush()
            if predicate():
                return
            data = await self.stream.receive_some(65536)
            if not data:
                self.eof = True
                self.transport.close_tail()
                return
            self.transport.push(data)

    def abort(self) -> None:
        """Close the socket with a TCP reset, as a killed process's kernel would."""
        self.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
        self.stream.socket.close()


async def test_client_killed_mid_stream_is_a_connection_close() -> None:
    handler = MemoryHandler()
    handler.queues["q"] = [f"m{i}" for i in range(10)]
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)
            client = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
            client.conn.open()
            session = client.conn.session()
            session.open()
            receiver = session.receiver("consumer")
            receiver.source.address = "q"
            receiver.target.address = "q"
            receiver.open()
            receiver.flow(4)
            await client.pump_until(lambda: receiver.queued >= 4)
            first = receiver.current
            assert first is not None
            receiver.advance()
            first.local.failed = True
            first.local.undeliverable = True
            first.local.annotations = {proton.symbol("x-reason"): "poison"}
            first.update(proton.Delivery.MODIFIED)
            first.settle()
            await client.flush()
            await handler.wait_for(lambda: bool(handler.outcomes))
            assert handler.outcomes == [
                (
                    ("q", "m0"),
                    amqp.Modified(
                        delivery_failed=True,
                        undeliverable_here=True,
                        annotations={"x-reason": "poison"},
                    ),
                )
            ]
            client.abort()
            await handler.wait_for(lambda: bool(handler.closed_conns))
            [(link, tokens)] = handler.closed_links
            assert isinstance(link, amqp.OutgoingLink)
            assert link.closed
            # The three messages sent and never settled are what the node must release.
            assert tokens == [("q", f"m{i}") for i in range(1, 4)]
            nursery.cancel_scope.cancel()


async def test_silent_client_is_dropped_by_idle_timeout() -> None:
    handler = MemoryHandler()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler, idle_timeout_s=0.3)
            client = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
            client.conn.open()
            await client.pump_until(lambda: bool(client.conn.state & proton.Endpoint.REMOTE_ACTIVE))
            # Stop answering: no heartbeats from here on.
            await handler.wait_for(lambda: bool(handler.closed_conns))
            await client.pump_until(lambda: client.eof)
            cond = client.conn.remote_condition or client.transport.condition
            assert cond is not None
            assert cond.name == "amqp:resource-limit-exceeded"
            assert handler.closed_conns[0].transport_error is not None
            await client.stream.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        # A valid AMQP header, then a frame header whose size is impossible.
        b"AMQP\x00\x01\x00\x00" + b"\x00\x00\x00\x05\x02\x00\x00\x00" + b"\xff" * 16,
    ],
)
async def test_malformed_bytes_close_that_connection_not_the_server(garbage: bytes) -> None:
    handler = MemoryHandler()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(garbage)
            received = b""
            while chunk := await stream.receive_some(65536):
                received += chunk
            await stream.aclose()
            # Proton answers with its own protocol header before closing.
            assert received.startswith(b"AMQP")
            await handler.wait_for(lambda: bool(handler.closed_conns))
            error = handler.closed_conns[0].transport_error
            assert error is not None
            assert error[0].startswith("amqp:")

            def good_client() -> None:
                conn = BlockingConnection(f"127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S)
                conn.create_sender("q").send(Message(body="still here"))
                conn.close()

            await in_thread(good_client)
            assert handler.queues["q"] == ["still here"]
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------
# TLS with client certificates
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client-a.example", common_name="client-a")
    d: Path = tmp_path_factory.mktemp("pki")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    client.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
    client.private_key_pem.write_to_path(str(d / "client.key"))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.configure_cert(ctx)
    ca.configure_trust(ctx)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return {"ctx": ctx, "dir": d}


def client_domain(pki: dict[str, Any], *, with_cert: bool) -> SSLDomain:
    d: Path = pki["dir"]
    domain = SSLDomain(SSLDomain.MODE_CLIENT)
    domain.set_trusted_ca_db(str(d / "ca.pem"))
    domain.set_peer_authentication(SSLDomain.VERIFY_PEER)
    if with_cert:
        domain.set_credentials(str(d / "client.pem"), str(d / "client.key"), None)
    return domain


async def test_tls_with_client_certificate(pki: dict[str, Any]) -> None:
    handler = MemoryHandler()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery, handler, ssl_context=pki["ctx"])

            def client() -> None:
                conn = BlockingConnection(
                    f"amqps://127.0.0.1:{port}",
                    timeout=CLIENT_TIMEOUT_S,
                    ssl_domain=client_domain(pki, with_cert=True),
                )
                conn.create_sender("secure").send(Message(body="over tls"))
                conn.close()

            def client_without_cert() -> None:
                with pytest.raises(ConnectionException):
                    BlockingConnection(
                        f"amqps://127.0.0.1:{port}",
                        timeout=CLIENT_TIMEOUT_S,
                        ssl_domain=client_domain(pki, with_cert=False),
                    )

            await in_thread(client)
            assert handler.queues["secure"] == ["over tls"]
            link = handler.attached[0]
            assert link.connection.identity == "client-a"
            assert link.connection.peer_certificate is not None
            await in_thread(client_without_cert)
            # The refused handshake never became a connection for the node.
            await handler.wait_for(lambda: len(handler.closed_conns) == 1)
            assert len(handler.attached) == 1
            nursery.cancel_scope.cancel()
