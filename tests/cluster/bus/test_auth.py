"""cluster/bus/auth and the embedded bus's handshake: only the members that
hold the site's key join; a peer without it is refused before it is sent
any frame of the stream and before anything it sends is sequenced, and the
members are unaffected.  The sequencer runs in this process on loopback TCP
(tests/support/embeddedbus.py)."""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from cluster.addresses import Address
from cluster.bus import BusConfig, BusEvent, Delivery, ViewChange
from cluster.bus.auth import (
    KEY_BYTES,
    BusKeyError,
    member_proof,
    read_key_file,
    sequencer_proof,
    write_key_file,
)
from cluster.bus.embedded import (
    CHALLENGE,
    ERROR,
    HELLO,
    MCAST,
    PROOF,
    REFUSED_KEY,
    WELCOME,
    EmbeddedMember,
    open_embedded_member,
)
from gateway.cli import main
from protocol.errors import BusError
from protocol.modes import Role
from tests.support.embeddedbus import open_embedded_site

DEADLINE_S = 10  # loopback TCP on a busy machine
_HEAD = struct.Struct(">IB")
_HELLO = struct.Struct(">IIB")


def frame(kind: int, body: bytes = b"") -> bytes:
    return _HEAD.pack(len(body) + 1, kind) + body


def split_frames(data: bytes) -> list[tuple[int, bytes]]:
    frames = []
    while data:
        length, kind = _HEAD.unpack_from(data)
        frames.append((kind, data[_HEAD.size : 4 + length]))
        data = data[4 + length :]
    return frames


async def read_until_eof(stream: trio.SocketStream) -> bytes:
    data = b""
    with trio.fail_after(DEADLINE_S):
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


async def next_event(events: AsyncIterator[BusEvent]) -> BusEvent:
    with trio.fail_after(DEADLINE_S):
        return await events.__anext__()


async def joined(member: EmbeddedMember) -> AsyncIterator[BusEvent]:
    """``member``'s events, after the view that adds it."""
    events = member.events()
    first = await next_event(events)
    assert isinstance(first, ViewChange) and member.me in first.members
    return events


# ---------------------------------------------------------------------------
# The key file and the proofs
# ---------------------------------------------------------------------------


def test_a_new_key_file_is_random_owner_only_and_never_replaced(tmp_path: Path) -> None:
    path = str(tmp_path / "bus.key")
    write_key_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    key = read_key_file(path)
    assert len(key) == KEY_BYTES
    with pytest.raises(BusKeyError, match="exists; a site has one key"):
        write_key_file(path)
    assert read_key_file(path) == key
    other = str(tmp_path / "other.key")
    write_key_file(other)
    assert read_key_file(other) != key


def test_a_key_file_others_may_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bus.key"
    write_key_file(str(path))
    path.chmod(0o644)
    with pytest.raises(BusKeyError) as caught:
        read_key_file(str(path))
    assert str(path) in str(caught.value)
    assert "mode 0644" in caught.value.problem
    assert caught.value.fix.startswith(f"run `chmod 0400 {path}`")
    path.chmod(0o600)
    assert len(read_key_file(str(path))) == KEY_BYTES


def test_the_two_proofs_differ_and_depend_on_key_and_transcript() -> None:
    key, other = b"k" * 32, b"o" * 32
    assert member_proof(key, b"t") == member_proof(key, b"t")
    # A sequencer's proof is never a member's (no reflection), and neither
    # holds for another key or another transcript (no replay).
    assert member_proof(key, b"t") != sequencer_proof(key, b"t")
    assert member_proof(key, b"t") != member_proof(other, b"t")
    assert member_proof(key, b"t") != member_proof(key, b"u")


def test_keygen_writes_a_key_and_refuses_to_overwrite_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "site-p.key"
    assert main(["keygen", "--bus", str(path)]) == 0
    assert f"to {path} (mode 0400)" in capsys.readouterr().out
    key = read_key_file(str(path))
    assert main(["keygen", "--bus", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"drgate keygen: {path} exists; a site has one key")
    assert read_key_file(str(path)) == key


def test_the_sequencer_will_not_start_on_a_key_others_may_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bus.key"
    write_key_file(str(path))
    path.chmod(0o640)
    assert main(["bus", "--group", "g", "--key-file", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"drgate bus: the bus key file {path} has mode 0640" in err
    assert "chmod 0400" in err


# ---------------------------------------------------------------------------
# The handshake on a real embedded bus
# ---------------------------------------------------------------------------


async def test_members_holding_the_site_key_join_and_exchange_frames() -> None:
    async with (
        open_embedded_site("site-p") as site,
        open_embedded_member(site.config(node=1), role=Role.BROKER) as a,
    ):
        a_events = await joined(a)
        async with open_embedded_member(site.config(node=2), role=Role.SIDECAR) as b:
            b_events = await joined(b)
            view = await next_event(a_events)
            assert isinstance(view, ViewChange) and view.joined == (b.me,)
            await a.multicast(b"from a")
            await b.multicast(b"from b")
            for events in (a_events, b_events):
                assert await next_event(events) == Delivery(a.me, b"from a")
                assert await next_event(events) == Delivery(b.me, b"from b")
        assert site.server.statistics().refused == 0


async def test_a_member_with_another_key_is_refused_and_the_site_sees_nothing_of_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with (
        open_embedded_site("site-p") as site,
        open_embedded_member(site.config(node=1), role=Role.BROKER) as a,
    ):
        events = await joined(a)
        stranger = site.other_key()
        with pytest.raises(BusError) as caught:
            async with open_embedded_member(
                site.config(node=2, key_file=stranger), role=Role.ADMIN
            ):
                pytest.fail("a member with another key joined the bus")
        text = str(caught.value)
        assert "refused this member: it does not hold the site's bus key" in text
        assert f"make bus.key_file ({stranger}) a copy of the key file" in text
        assert "`drgate bus --key-file`" in text
        stats = site.server.statistics()
        assert (stats.refused, stats.members, stats.view_id) == (1, 1, 1)
        assert "did not prove that it holds the bus key" in caplog.text
        # The member's stream goes on with no view change for the stranger.
        await a.multicast(b"after")
        assert await next_event(events) == Delivery(a.me, b"after")


async def test_a_member_without_a_key_file_is_refused_before_connecting() -> None:
    async with open_embedded_site("site-p") as site:
        config = BusConfig("embedded", "site-p", 1, site.bus.address, key_file=None)
        with pytest.raises(BusError, match=r"needs its key file \(bus\.key_file\); make one with"):
            async with open_embedded_member(config, role=Role.ADMIN):
                pytest.fail("joined without a key")
        assert site.server.statistics().refused == 0  # it never connected


ANSWERS = ["zero proof", "another key's proof", "no proof, a multicast"]


@pytest.mark.parametrize("answer", ANSWERS)
async def test_a_peer_without_the_key_gets_no_frame_of_the_stream_and_sends_none_into_it(
    answer: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        open_embedded_site("site-p") as site,
        open_embedded_member(site.config(node=1), role=Role.BROKER) as a,
    ):
        events = await joined(a)
        assert site.bus.address is not None
        stream = await trio.open_tcp_stream(site.bus.address.host, site.bus.address.port)
        peer = "{}:{}".format(*stream.socket.getsockname()[:2])
        async with stream:
            hello = _HELLO.pack(9, 1, int(Role.ADMIN)) + os.urandom(32) + b"site-p"
            await stream.send_all(frame(HELLO, hello))
            # The member multicasts while the stranger is between HELLO and PROOF.
            await a.multicast(b"secret")
            assert await next_event(events) == Delivery(a.me, b"secret")
            challenge = b""
            with trio.fail_after(DEADLINE_S):
                while len(challenge) < 5 + 32:
                    challenge += await stream.receive_some(64)
            transcript = hello + split_frames(challenge)[0][1]
            if answer == "zero proof":
                reply = frame(PROOF, bytes(32))
            elif answer == "another key's proof":
                reply = frame(PROOF, member_proof(read_key_file(site.other_key()), transcript))
            else:
                reply = frame(MCAST, b"forged")
            await stream.send_all(reply + frame(MCAST, b"forged"))
            rest = await read_until_eof(stream)
        # Nothing but the handshake's CHALLENGE and the refusal: no VIEW, no DELIVER.
        assert [k for k, _ in split_frames(challenge + rest)] == [CHALLENGE, ERROR]
        assert split_frames(rest)[0][1].decode() == REFUSED_KEY
        assert f"bus peer {peer} refused" in caplog.text
        # Nothing it sent was sequenced, and no view change happened.
        await a.multicast(b"after")
        assert await next_event(events) == Delivery(a.me, b"after")
        stats = site.server.statistics()
        assert (stats.refused, stats.sequenced, stats.view_id) == (1, 2, 1)


async def test_a_stranger_cannot_make_the_sequencer_buffer_a_large_frame() -> None:
    async with open_embedded_site("site-p") as site:
        assert site.bus.address is not None
        async with await trio.open_tcp_stream(
            site.bus.address.host, site.bus.address.port
        ) as stream:
            # A HELLO that claims 1 MiB: dropped at its header.
            await stream.send_all(_HEAD.pack(1 << 20, HELLO) + b"x" * 1000)
            assert await read_until_eof(stream) == b""
        assert site.server.statistics().members == 0


async def test_a_member_does_not_trust_a_sequencer_that_cannot_prove_the_key(
    tmp_path: Path,
) -> None:
    """An impostor at bus.address (no key) that admits anyone: the member
    refuses its WELCOME before reading any frame of its stream."""
    key_file = str(tmp_path / "bus.key")
    write_key_file(key_file)

    async def impostor(stream: trio.SocketStream) -> None:
        await stream.receive_some(4096)  # HELLO
        await stream.send_all(frame(CHALLENGE, os.urandom(32)))
        await stream.receive_some(4096)  # PROOF, not checked
        await stream.send_all(frame(WELCOME, struct.pack(">II", 1, 1) + bytes(32)))
        await stream.receive_some(4096)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, impostor, 0)
        port = listeners[0].socket.getsockname()[1]
        config = BusConfig("embedded", "site-p", 1, Address("127.0.0.1", port), key_file)
        with pytest.raises(BusError) as caught:
            async with open_embedded_member(config, role=Role.ADMIN):
                pytest.fail("the member trusted an impostor")
        assert f"did not prove that it holds the bus key in {key_file}" in str(caught.value)
        assert "check bus.address" in str(caught.value)
        nursery.cancel_scope.cancel()


async def test_a_peer_that_never_finishes_the_handshake_is_closed_and_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("cluster.bus.embedded.HELLO_TIMEOUT_S", 0.2)
    async with open_embedded_site("site-p") as site:
        assert site.bus.address is not None
        stream = await trio.open_tcp_stream(site.bus.address.host, site.bus.address.port)
        peer = "{}:{}".format(*stream.socket.getsockname()[:2])
        async with stream:
            await stream.send_all(frame(HELLO, b"")[:3])  # half a frame head, then silence
            with trio.fail_after(DEADLINE_S):
                assert await read_until_eof(stream) == b""
        assert f"bus peer {peer} closed: it did not finish the handshake" in caplog.text


async def test_a_peer_reset_during_the_handshake_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with open_embedded_site("site-p") as site:
        assert site.bus.address is not None
        stream = await trio.open_tcp_stream(site.bus.address.host, site.bus.address.port)
        peer = "{}:{}".format(*stream.socket.getsockname()[:2])
        await stream.send_all(frame(HELLO, b"")[:3])
        # A TCP reset, as a killed process's kernel would send.
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stream.socket.close()
        with trio.fail_after(DEADLINE_S):
            while f"bus peer {peer} closed during the handshake" not in caplog.text:  # noqa: ASYNC110
                await trio.sleep(0.01)  # polling the sequencer's log
