"""AMQP security of the broker: SASL, users and rights, the connection and memory caps.

A real ``BrokerNode`` on the in-memory bus (tests/support/membus.py) serves
Proton's own ``BlockingConnection`` over loopback sockets (and TLS); the
clients run in threads.  The users file is written by the real
``drgate admin user add``.
"""

from __future__ import annotations

import io
import itertools
import json
import stat
import unittest.mock
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from proton import ConnectionException, Disposition, Message, SSLDomain
from proton.utils import BlockingConnection, LinkDetached

from cluster.addresses import Address
from cluster.amqpauth import (
    AMQP_HEADER,
    AmqpSecurity,
    encode_sasl_frame,
    load_users,
    parse_sasl_frame_untrusted,
)
from cluster.bus import BusConfig
from cluster.node import BrokerConfig, BrokerNode
from cluster.tls import TlsFiles
from gateway.cli import main
from protocol.errors import RemoteProtocolError
from tests.support.membus import MemoryBus, open_memory_member

pytestmark = pytest.mark.integration

TIMEOUT_S = 30
CLIENT_TIMEOUT_S = 10
LINK_NAMES = itertools.count(1)
PASSWORDS = {"alice": "wonderland", "root": "toor"}


def add_user(path: Path, name: str, *options: str, password: str | None = None) -> int:
    """``drgate admin user add NAME OPTIONS --file PATH`` with the password on stdin."""
    text = PASSWORDS[name] if password is None else password
    with unittest.mock.patch("sys.stdin", io.StringIO(text + "\n")):
        return main(["admin", "user", "add", name, *options, "--file", str(path)])


@pytest.fixture(scope="module")
def users_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("users") / "users.json"
    assert add_user(path, "alice", "--publish", "orders.*", "--consume", "orders.*") == 0
    assert add_user(path, "root", "--admin") == 0
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(str(folder / "server.pem"))
    server.private_key_pem.write_to_path(str(folder / "server.key"))
    for name in ("client-a", "mallory"):
        cert = ca.issue_cert(f"{name}.example", common_name=name)
        cert.cert_chain_pems[0].write_to_path(str(folder / f"{name}.pem"))
        cert.private_key_pem.write_to_path(str(folder / f"{name}.key"))
    files = TlsFiles(
        cert=str(folder / "server.pem"), key=str(folder / "server.key"), ca=str(folder / "ca.pem")
    )
    return {"dir": folder, "files": files}


def client_domain(pki: dict[str, Any], name: str | None) -> SSLDomain:
    folder: Path = pki["dir"]
    domain = SSLDomain(SSLDomain.MODE_CLIENT)
    domain.set_trusted_ca_db(str(folder / "ca.pem"))
    domain.set_peer_authentication(SSLDomain.VERIFY_PEER)
    if name is not None:
        domain.set_credentials(str(folder / f"{name}.pem"), str(folder / f"{name}.key"), None)
    return domain


@asynccontextmanager
async def broker(**options: Any) -> AsyncIterator[tuple[BrokerNode, int]]:
    """A one-node site on a memory bus, its AMQP listener on 127.0.0.1."""
    config = BrokerConfig(
        cluster="site-p",
        node=1,
        bus=BusConfig(backend="embedded", group="site-p", node=1),
        amqp=Address("127.0.0.1", 0),
        **options,
    )
    node = BrokerNode(config, open_member=open_memory_member(MemoryBus()))
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            port: int = await nursery.start(node.serve)
            yield node, port
            nursery.cancel_scope.cancel()


def secured(path: Path, **options: Any) -> dict[str, Any]:
    users = load_users(str(path))
    return {"security": AmqpSecurity(users=users, users_file=str(path), **options)}


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def connect(port: int, user: str | None = None, **kwargs: Any) -> BlockingConnection:
    if user is not None:
        kwargs.setdefault("password", PASSWORDS.get(user))
        kwargs["user"] = user
    scheme = "amqps" if "ssl_domain" in kwargs else "amqp"
    return BlockingConnection(f"{scheme}://127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S, **kwargs)


def admin_request(conn: BlockingConnection, request: dict[str, Any]) -> Any:
    sender = conn.create_sender("$drgate.admin", name=f"admin-{next(LINK_NAMES)}")
    return sender.send(Message(body=json.dumps(request)), error_states=[]).remote_state


def publish(conn: BlockingConnection, address: str, bodies: list[str]) -> list[tuple[str, str]]:
    """Send each body; the refused ones as (condition, description)."""
    sender = conn.create_sender(address)
    refused = []
    for body in bodies:
        delivery = sender.send(Message(body=body), error_states=[])
        if delivery.remote_state != Disposition.ACCEPTED:
            cond = delivery.remote.condition
            refused.append((str(cond.name), str(cond.description)))
    return refused


def consume_all(conn: BlockingConnection, address: str) -> list[str]:
    receiver = conn.create_receiver(address, credit=100)
    bodies = []
    while True:
        try:
            message = receiver.receive(timeout=0.5)  # an empty queue: nothing comes
        except Exception:  # proton.Timeout
            return bodies
        bodies.append(message.body)
        receiver.accept()


# ---------------------------------------------------------------------------
# The users file and its command
# ---------------------------------------------------------------------------


def test_user_add_writes_a_0600_file_of_argon2_hashes_and_replaces_an_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from argon2 import PasswordHasher

    path = tmp_path / "users.json"
    assert add_user(path, "alice", "--publish", "a.*", password="first") == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "first" not in path.read_text()
    assert add_user(path, "alice", "--consume", "b.*", "--admin", password="second") == 0
    assert add_user(path, "bob", password="third") == 0
    users = load_users(str(path))
    assert sorted(users) == ["alice", "bob"]
    alice = users["alice"]
    assert (alice.admin, alice.publish, alice.consume) == (True, (), ("b.*",))
    assert PasswordHasher().verify(alice.password_hash, "second")
    assert "restart the brokers" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["users.json"]  # no temporary left


def test_user_add_refuses_an_empty_password_and_a_file_that_is_not_a_users_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "users.json"
    assert add_user(path, "alice", password="") == 1
    assert "empty password" in capsys.readouterr().err
    assert not path.exists()
    path.write_text("[1, 2]")
    assert add_user(path, "alice", password="x") == 1
    assert "no 'users' mapping" in capsys.readouterr().err
    assert path.read_text() == "[1, 2]"


# ---------------------------------------------------------------------------
# Authentication
# ---------------------------------------------------------------------------


async def test_plain_good_password_is_in_and_bad_password_or_anonymous_is_out(
    users_file: Path,
) -> None:
    async with broker(**secured(users_file)) as (_, port):

        def good() -> list[tuple[str, str]]:
            conn = connect(port, "root")
            try:
                assert admin_request(conn, {"op": "add-queue", "name": "orders.new"}) == (
                    Disposition.ACCEPTED
                )
                return publish(conn, "orders.new", ["one"])
            finally:
                conn.close()

        assert await in_thread(good) == []
        for bad in ({"user": "alice", "password": "guess"}, {"user": "eve", "password": "x"}, {}):
            with pytest.raises(ConnectionException, match="unauthorized-access"):
                await in_thread(lambda bad=bad: connect(port, **bad))


async def test_anonymous_is_refused_on_a_tls_listener_with_users(
    users_file: Path, pki: dict[str, Any]
) -> None:
    """A certificate that names nobody in the users file is refused, whatever
    mechanism its client picks; one that does gets that user's rights."""
    options = secured(users_file, identities={"client-a": "alice"})
    async with broker(tls=pki["files"], **options) as (node, port):
        for mechs in ("ANONYMOUS", "EXTERNAL", None):
            with pytest.raises(ConnectionException, match="unauthorized-access"):
                await in_thread(
                    lambda m=mechs: connect(
                        port, ssl_domain=client_domain(pki, "mallory"), allowed_mechs=m
                    )
                )

        def mapped() -> str:
            conn = connect(port, ssl_domain=client_domain(pki, "client-a"))
            try:
                with pytest.raises(LinkDetached, match="unauthorized-access"):
                    conn.create_sender("$drgate.admin")
                return "ok"
            finally:
                conn.close()

        assert await in_thread(mapped) == "ok"
        assert node.config.security.users is not None


async def test_a_client_that_skips_sasl_is_refused_when_users_are_configured(
    users_file: Path,
) -> None:
    async with broker(**secured(users_file)) as (_, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(AMQP_HEADER)
        received = b""
        while chunk := await stream.receive_some(1024):
            received += chunk
        await stream.aclose()
        # A server that requires SASL answers with the SASL header and closes.
        assert received == b"AMQP\x03\x01\x00\x00"


def test_a_malformed_sasl_frame_is_a_remote_protocol_error() -> None:
    frame = encode_sasl_frame(0x41, ["PLAIN", b"\0a\0b"])
    assert parse_sasl_frame_untrusted(frame[:-1]) is None  # more bytes needed
    descriptor, fields, size = parse_sasl_frame_untrusted(frame + b"AMQP") or (0, [], 0)
    assert (descriptor, fields, size) == (0x41, ["PLAIN", b"\0a\0b"], len(frame))
    with pytest.raises(RemoteProtocolError, match="frame header"):
        parse_sasl_frame_untrusted(b"\x00\x10\x00\x00\x02\x00\x00\x00" + b"\0" * 8)
    with pytest.raises(RemoteProtocolError, match="undecodable"):
        parse_sasl_frame_untrusted(b"\x00\x00\x00\x0c\x02\x01\x00\x00\xff\xff\xff\xff")


# ---------------------------------------------------------------------------
# Rights
# ---------------------------------------------------------------------------


async def test_a_user_without_the_right_is_detached_with_unauthorized_access(
    users_file: Path,
) -> None:
    async with broker(**secured(users_file)) as (_, port):

        def setup() -> None:
            conn = connect(port, "root")
            for name in ("orders.new", "billing"):
                assert admin_request(conn, {"op": "add-queue", "name": name}) == (
                    Disposition.ACCEPTED
                )
            conn.close()

        def as_alice() -> dict[str, str]:
            conn = connect(port, "alice")
            errors = {}
            try:
                for what, attach in (
                    ("admin", lambda: conn.create_sender("$drgate.admin")),
                    ("listing", lambda: conn.create_receiver("$drgate.queues")),
                    ("publish", lambda: conn.create_sender("billing")),
                    ("consume", lambda: conn.create_receiver("billing")),
                ):
                    with pytest.raises(LinkDetached) as caught:
                        attach()
                    errors[what] = str(caught.value)
                assert publish(conn, "orders.new", ["mine"]) == []
                # The anonymous relay: each message is checked against its address.
                relay = conn.create_sender(None)
                delivery = relay.send(Message(address="billing", body="x"), error_states=[])
                cond = delivery.remote.condition
                errors["relay"] = f"{cond.name}: {cond.description}"
                assert consume_all(conn, "orders.new") == ["mine"]
            finally:
                conn.close()
            return errors

        await in_thread(setup)
        errors = await in_thread(as_alice)
    assert all("amqp:unauthorized-access" in text for text in errors.values()), errors
    assert "user 'alice' may not manage '$drgate.admin'" in errors["admin"]
    assert f"drgate admin user add alice --admin --file {users_file}" in errors["admin"]
    assert "may not publish 'billing'" in errors["publish"]
    assert "publish patterns orders.*" in errors["publish"]
    assert "--publish billing" in errors["publish"]
    assert "may not consume 'billing'" in errors["consume"]
    assert "may not publish 'billing'" in errors["relay"]


# ---------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------


async def test_the_connection_past_the_cap_is_refused_at_open() -> None:
    async with broker(security=AmqpSecurity(max_connections=2)) as (_, port):
        first = await in_thread(lambda: connect(port))
        second = await in_thread(lambda: connect(port))
        with pytest.raises(ConnectionException) as caught:
            await in_thread(lambda: connect(port))
        assert "amqp:resource-limit-exceeded" in str(caught.value)
        assert "at most 2 connections" in str(caught.value)
        assert "'amqp.max_connections'" in str(caught.value)
        await in_thread(first.close)
        # The freed place is taken again, once the server has seen the close
        # (each refused attempt is a full round trip: no sleep needed).
        with trio.fail_after(TIMEOUT_S):
            while True:
                try:
                    third = await in_thread(lambda: connect(port))
                    break
                except ConnectionException:
                    continue
        await in_thread(third.close)
        await in_thread(second.close)


async def test_a_publish_past_the_site_memory_cap_is_refused_and_nothing_is_lost() -> None:
    body = "x" * 200
    async with broker(max_site_bytes=1500) as (node, port):

        def fill() -> tuple[int, list[tuple[str, str]]]:
            conn = connect(port)
            try:
                admin_request(conn, {"op": "add-queue", "name": "q"})
                refused = publish(conn, "q", [f"{i}{body}" for i in range(10)])
                return 10 - len(refused), refused
            finally:
                conn.close()

        accepted, refused = await in_thread(fill)
        assert 0 < accepted < 10
        assert {cond for cond, _ in refused} == {"amqp:resource-limit-exceeded"}
        assert "cap of 1500" in refused[0][1] and "'max_site_bytes'" in refused[0][1]
        assert node.member.state.queues["q"].bytes <= 1500

        def drain_then_publish() -> tuple[list[str], list[tuple[str, str]]]:
            conn = connect(port)
            try:
                drained = consume_all(conn, "q")
                return drained, publish(conn, "q", ["again"])
            finally:
                conn.close()

        drained, again = await in_thread(drain_then_publish)
    assert drained == [f"{i}{body}" for i in range(accepted)]  # every accepted one, once
    assert again == []
