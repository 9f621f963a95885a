"""Embedded site bus: a sequencer on loopback and members over TCP.

Theory of operation
-------------------
One sequencer process (``drgate bus``) serves one group.  A member connects
and both prove they hold the site's key (cluster/bus/auth.py): the member
says HELLO (node, role, a nonce, group), the sequencer answers CHALLENGE (its
nonce), the member sends PROOF, and the sequencer, once the proof matches,
sends WELCOME with the member's ``MemberId`` (its node and the sequencer's
connection number) and its own proof, which the member checks before it
reads anything else.  A peer that fails gets ERROR and is closed before it
becomes a member: nothing of the stream reaches it and nothing it sends is
sequenced.  Frames before WELCOME are small (``HANDSHAKE_MAX_FRAME_BYTES``)
and the whole handshake has a deadline, so a stranger costs little.  Every
connection has a
reader task that posts what it reads (join, a batch of the multicasts one
socket read brought, leave) into one bounded inbox; a single sequencer task
takes the inbox in arrival order, and that order *is* the agreed order: for
each item it encodes the frames (DELIVERs or a VIEW) and puts them, as one
buffer, in the bounded outbox of every member, the sender included.  A writer
task per connection drains its outbox to the socket.  Batching keeps the
per-message work down to encoding: one inbox item, one outbox item per member
and one socket write carry many messages.

View changes happen on join, on goodbye, on EOF and on a broken socket (a
member killed without a goodbye), always at one point of the single ordered
sequence, so every member sees them at the same point of its stream.  The
embedded bus has no partitions, so every view is quorate.

Backpressure: every buffer is bounded.  A slow member fills its outbox, the
sequencer waits on it, the inbox fills, readers stop reading, TCP windows
close and ``multicast`` waits in ``send_all``.  The whole bus runs at the
pace of its slowest reader, as a virtually synchronous bus must.

It is a single process with no persistence and no failover: a test and
single-machine engine, not a production one (corosync is).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from cluster.bus.auth import (
    KEYGEN_HINT,
    NONCE_BYTES,
    PROOF_BYTES,
    member_proof,
    new_nonce,
    proof_matches,
    read_key_file,
    sequencer_proof,
)
from cluster.bus.contract import (
    BusConfig,
    BusEvent,
    BusStatistics,
    Delivery,
    MemberId,
    ViewChange,
)
from protocol.errors import BusError, RemoteProtocolError
from protocol.modes import Role

log = logging.getLogger(__name__)

# --- wire format ------------------------------------------------------------
#
# Every frame:   u32 length (of what follows, big-endian) | u8 type | body
#
# HELLO    c->s  u32 node | u32 pid | u8 role | member nonce (32 bytes) |
#                group (utf-8, rest of frame)
# CHALLENGE s->c sequencer nonce (32 bytes)
# PROOF    c->s  HMAC-SHA256(key, member label | HELLO body | sequencer nonce)
# WELCOME  s->c  u32 node | u32 member number | HMAC-SHA256(key, sequencer
#                label | HELLO body | sequencer nonce | u32 node | u32 number)
# MCAST    c->s  payload (rest of frame)
# DELIVER  s->c  u32 sender node | u32 sender number | payload (rest of frame)
# VIEW     s->c  u64 view id | u8 quorate | u16 n members | u16 n joined |
#                u16 n left | (u32 node, u32 number) * (members+joined+left)
# ERROR    s->c  text (utf-8, rest of frame)
# GOODBYE  c->s  (empty)

HELLO, WELCOME, MCAST, DELIVER, VIEW, ERROR, GOODBYE, CHALLENGE, PROOF = range(1, 10)
_FRAME_HEAD = struct.Struct(">IB")
_HELLO = struct.Struct(">IIB")
_IDPAIR = struct.Struct(">II")
_VIEW = struct.Struct(">QBHHH")

# A frame carries one whole message; 64 MiB is far above what the application
# sends (the largest test payload is 5 MB) and stops a corrupt length from
# making us allocate gigabytes.
MAX_FRAME_BYTES = 64 * 1024 * 1024
# Events decoded but not yet read by the application.  The member stops
# reading its socket when it is full, which is what slows the sequencer down.
EVENTS_QUEUE_LIMIT = 128
# Frames waiting for one member's socket at the sequencer.
OUTBOX_LIMIT = 64
# Items waiting for the sequencer task (joins, batches of multicasts, leaves).
INBOX_LIMIT = 64
# Multicasts a connection's reader hands to the sequencer in one inbox item:
# what one socket read brought, at most this many frames.
INBOX_BATCH = 64
# Events read by the application between two yields to the scheduler.
READS_PER_CHECKPOINT = 32
# Writers coalesce up to this many queued frames into one send.
_COALESCE_FRAMES = 64
_RECEIVE_BYTES = 256 * 1024
# The whole handshake, HELLO to WELCOME, on either side.
HELLO_TIMEOUT_S = 10.0
# Frames before WELCOME: a HELLO with a group name of a few hundred bytes at
# most, and a proof; a stranger must not make us buffer more.
HANDSHAKE_MAX_FRAME_BYTES = 4096
# The ERROR text for a peer whose PROOF does not match: the member side knows
# it by this text and names its key file in its own error.
REFUSED_KEY = "the member did not prove that it holds this bus's key"
# How long a refused peer gets to read its ERROR and close.
REFUSE_LINGER_S = 2.0


def _frame(kind: int, body: bytes = b"") -> bytes:
    return _FRAME_HEAD.pack(len(body) + 1, kind) + body


def encode_view(view: ViewChange) -> bytes:
    head = _VIEW.pack(
        view.view_id, int(view.quorate), len(view.members), len(view.joined), len(view.left)
    )
    ids = b"".join(_IDPAIR.pack(m.node, m.pid) for m in (*view.members, *view.joined, *view.left))
    return _frame(VIEW, head + ids)


def decode_view_untrusted(body: bytes) -> ViewChange:
    try:
        view_id, quorate, n_members, n_joined, n_left = _VIEW.unpack_from(body)
        total = n_members + n_joined + n_left
        if len(body) != _VIEW.size + total * _IDPAIR.size:
            raise RemoteProtocolError(f"VIEW frame of {len(body)} bytes for {total} member ids")
        ids = [
            MemberId(*_IDPAIR.unpack_from(body, _VIEW.size + i * _IDPAIR.size))
            for i in range(total)
        ]
    except struct.error as exc:
        raise RemoteProtocolError(f"short VIEW frame: {exc}") from None
    return ViewChange(
        view_id=view_id,
        members=tuple(ids[:n_members]),
        joined=tuple(ids[n_members : n_members + n_joined]),
        left=tuple(ids[n_members + n_joined :]),
        quorate=bool(quorate),
    )


class _FrameReader:
    """Reads whole frames from a trio stream; ``None`` at a clean EOF."""

    def __init__(self, stream: trio.abc.ReceiveStream, *, max_frame: int = MAX_FRAME_BYTES) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self.max_frame = max_frame  # raised once the peer is authenticated

    async def read_frame_untrusted(self) -> tuple[int, bytes] | None:
        while True:
            frames = self.buffered_frames_untrusted(1)
            if frames:
                return frames[0]
            if not await self.receive_more():
                return None

    def buffered_frames_untrusted(self, limit: int) -> list[tuple[int, bytes]]:
        """Up to ``limit`` whole frames already received, without waiting."""
        buffer = self._buffer
        frames: list[tuple[int, bytes]] = []
        size = len(buffer)
        pos = 0
        with memoryview(buffer) as view:
            while len(frames) < limit and size - pos >= _FRAME_HEAD.size:
                length, kind = _FRAME_HEAD.unpack_from(buffer, pos)
                if length < 1 or length > self.max_frame:
                    raise RemoteProtocolError(f"frame length {length} outside 1..{self.max_frame}")
                end = pos + 4 + length
                if end > size:
                    break
                frames.append((kind, bytes(view[pos + _FRAME_HEAD.size : end])))
                pos = end
        if pos:
            del buffer[:pos]
        return frames

    async def receive_more(self) -> bool:
        """Read what the peer sent next; ``False`` at a clean EOF."""
        data = await self._stream.receive_some(_RECEIVE_BYTES)
        if not data:
            if self._buffer:
                raise RemoteProtocolError(
                    f"connection closed inside a frame ({len(self._buffer)} bytes)"
                )
            return False
        self._buffer += data
        return True


# --- sequencer ----------------------------------------------------------------

# What a connection that ends under us raises.
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


@dataclass(eq=False)
class _Connection:
    number: int
    stream: trio.SocketStream
    member: MemberId | None = None
    outbox_send: trio.MemorySendChannel[bytes] | None = None
    outbox_recv: trio.MemoryReceiveChannel[bytes] | None = None
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)


@dataclass(frozen=True, slots=True)
class SequencerStatistics:
    members: int
    view_id: int
    sequenced: int
    refused: int  # connections refused before they became members
    inbox_queued: int
    inbox_limit: int
    outbox_queued_max: int
    outbox_limit: int


class SequencerServer:
    """The embedded bus engine for one group, admitting only the members
    that prove they hold ``key`` (:mod:`cluster.bus.auth`).  Run with
    :meth:`serve`."""

    def __init__(self, group: str, *, key: bytes) -> None:
        self.group = group
        self._key = key
        self._refused = 0
        self._numbers = itertools.count(1)
        self._members: dict[int, _Connection] = {}
        self._view_id = 0
        self._sequenced = 0
        self._outbox_max = 0
        self._inbox_send, self._inbox_recv = trio.open_memory_channel[
            tuple[str, _Connection, list[bytes]]
        ](INBOX_LIMIT)

    def statistics(self) -> SequencerStatistics:
        return SequencerStatistics(
            members=len(self._members),
            view_id=self._view_id,
            sequenced=self._sequenced,
            refused=self._refused,
            inbox_queued=self._inbox_send.statistics().current_buffer_used,
            inbox_limit=INBOX_LIMIT,
            outbox_queued_max=self._outbox_max,
            outbox_limit=OUTBOX_LIMIT,
        )

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (0 picks a port) and serve until cancelled.

        ``task_status.started`` receives the bound ``(host, port)``.
        """
        listeners = await trio.open_tcp_listeners(port, host=host)
        sockname = listeners[0].socket.getsockname()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sequence)
            nursery.start_soon(trio.serve_listeners, self._handle, listeners)
            task_status.started((sockname[0], sockname[1]))

    async def _sequence(self) -> None:
        async for kind, conn, payloads in self._inbox_recv:
            if kind == "join":
                assert conn.member is not None
                self._members[conn.number] = conn
                await self._view(joined=(conn.member,), left=())
            elif kind == "mcast":
                if conn.number in self._members and conn.member is not None:
                    self._sequenced += len(payloads)
                    sender = _IDPAIR.pack(conn.member.node, conn.member.pid)
                    parts = []
                    for payload in payloads:
                        parts.append(_FRAME_HEAD.pack(len(payload) + 9, DELIVER) + sender)
                        parts.append(payload)
                    await self._broadcast(b"".join(parts))
            else:  # leave
                await self._drop(conn)

    async def _drop(self, conn: _Connection) -> None:
        if self._members.pop(conn.number, None) is None:
            return
        if conn.outbox_send is not None:
            conn.outbox_send.close()
        assert conn.member is not None
        await self._view(joined=(), left=(conn.member,))

    async def _view(self, *, joined: tuple[MemberId, ...], left: tuple[MemberId, ...]) -> None:
        self._view_id += 1
        members = tuple(sorted(c.member for c in self._members.values() if c.member))
        view = ViewChange(self._view_id, members, joined, left, quorate=True)
        await self._broadcast(encode_view(view))

    async def _broadcast(self, frame: bytes) -> None:
        dead = []
        for conn in list(self._members.values()):
            assert conn.outbox_send is not None
            try:
                # Without a checkpoint while the outbox has room: a frame
                # goes to every member in one pass of the sequencer.
                try:
                    conn.outbox_send.send_nowait(frame)
                except trio.WouldBlock:
                    await conn.outbox_send.send(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # Its writer died (peer reset, killed): it leaves here, at one
                # point of the order, whether or not its reader saw EOF yet.
                dead.append(conn)
            else:
                used = conn.outbox_send.statistics().current_buffer_used
                self._outbox_max = max(self._outbox_max, used)
        for conn in dead:
            await self._drop(conn)

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = _Connection(next(self._numbers), stream)
        reader = _FrameReader(stream, max_frame=HANDSHAKE_MAX_FRAME_BYTES)
        peer = _peer(stream)
        try:
            node = None
            with trio.move_on_after(HELLO_TIMEOUT_S) as handshake:
                node = await self._admit(stream, reader, conn.number)
            if handshake.cancelled_caught:
                log.warning(
                    "bus peer %s closed: it did not finish the handshake within %.0f s",
                    peer,
                    HELLO_TIMEOUT_S,
                    extra={"peer": peer, "group": self.group},
                )
            if node is None:
                return
            reader.max_frame = MAX_FRAME_BYTES
            conn.member = MemberId(node, conn.number)
            conn.outbox_send, conn.outbox_recv = trio.open_memory_channel[bytes](OUTBOX_LIMIT)
            async with trio.open_nursery() as nursery:
                conn.cancel_scope = nursery.cancel_scope
                nursery.start_soon(self._write_loop, conn)
                await self._inbox_send.send(("join", conn, []))
                try:
                    await self._read_loop(conn, reader)
                except _GONE as exc:
                    # A reset ends this member like an EOF does.
                    log.info("member %s (%s) left: %r", conn.member, peer, exc)
                except RemoteProtocolError as exc:
                    log.warning("member %s (%s) dropped: bad frame: %s", conn.member, peer, exc)
                # Stop the writer only once the sequencer has closed our
                # outbox (after the leave): it flushes what is queued.
                await self._inbox_send.send(("leave", conn, []))
        except (*_GONE, RemoteProtocolError) as exc:
            if conn.member is None:
                log.warning(
                    "bus peer %s closed during the handshake: %r",
                    peer,
                    exc,
                    extra={"peer": peer, "group": self.group},
                )
        finally:
            if conn.member is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await self._inbox_send.send(("leave", conn, []))
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await trio.aclose_forcefully(stream)

    async def _admit(
        self, stream: trio.SocketStream, reader: _FrameReader, number: int
    ) -> int | None:
        """The handshake (module docstring): the peer's node once it proved it
        holds the key and asked for our group, after WELCOME is sent; None
        once it is refused.  Refusals are logged with the peer's address."""
        hello = await reader.read_frame_untrusted()
        if hello is None or hello[0] != HELLO or len(hello[1]) < _HELLO.size + NONCE_BYTES:
            what = "nothing" if hello is None else f"frame type {hello[0]}"
            await self._refuse(stream, f"sent {what} where a HELLO was due", "expected HELLO")
            return None
        nonce = new_nonce()
        await stream.send_all(_frame(CHALLENGE, nonce))
        transcript = hello[1] + nonce
        proof = await reader.read_frame_untrusted()
        if (
            proof is None
            or proof[0] != PROOF
            or not proof_matches(member_proof(self._key, transcript), proof[1])
        ):
            await self._refuse(stream, "did not prove that it holds the bus key", REFUSED_KEY)
            return None
        node: int = _HELLO.unpack_from(hello[1])[0]
        group = hello[1][_HELLO.size + NONCE_BYTES :].decode("utf-8", "replace")
        if group != self.group:
            text = f"this sequencer serves group {self.group!r}, not {group!r}"
            await self._refuse(stream, f"asked for group {group!r}", text)
            return None
        ids = _IDPAIR.pack(node, number)
        await stream.send_all(_frame(WELCOME, ids + sequencer_proof(self._key, transcript + ids)))
        return node

    async def _refuse(self, stream: trio.SocketStream, why: str, text: str) -> None:
        self._refused += 1
        peer = _peer(stream)
        log.warning(
            "bus peer %s refused: it %s",
            peer,
            why,
            extra={"peer": peer, "group": self.group},
        )
        await stream.send_all(_frame(ERROR, text.encode()))
        # Let the ERROR reach the peer: closing with its unread bytes still
        # here would reset the connection, and a reset may discard the ERROR.
        await stream.send_eof()
        with trio.move_on_after(REFUSE_LINGER_S):
            while await stream.receive_some(_RECEIVE_BYTES):
                pass

    async def _read_loop(self, conn: _Connection, reader: _FrameReader) -> None:
        while True:
            frames = reader.buffered_frames_untrusted(INBOX_BATCH)
            if not frames:
                if not await reader.receive_more():
                    return
                continue
            payloads = []
            goodbye = False
            for kind, body in frames:
                if kind == MCAST:
                    payloads.append(body)
                elif kind == GOODBYE:
                    goodbye = True
                    break
                else:
                    raise RemoteProtocolError(f"unexpected frame type {kind} from a member")
            if payloads:
                await self._inbox_send.send(("mcast", conn, payloads))
            if goodbye:
                return

    async def _write_loop(self, conn: _Connection) -> None:
        assert conn.outbox_recv is not None
        try:
            async for frame in conn.outbox_recv:
                frames = [frame]
                while len(frames) < _COALESCE_FRAMES:
                    try:
                        frames.append(conn.outbox_recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await conn.stream.send_all(b"".join(frames))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            # Never let the sequencer wait on a member that cannot be written
            # to: closing our end makes its next send fail at once.
            conn.outbox_recv.close()
            conn.cancel_scope.cancel()


def _peer(stream: trio.SocketStream) -> str:
    """``host:port`` of the other end, for the log."""
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "unknown"
    return f"{host}:{port}"


async def serve_sequencer(
    host: str,
    port: int,
    group: str,
    *,
    key: bytes,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an embedded sequencer for ``group`` until cancelled, admitting
    the members that hold ``key`` (:func:`cluster.bus.auth.read_key_file`)."""
    await SequencerServer(group, key=key).serve(host, port, task_status=task_status)


# --- member -------------------------------------------------------------------


class _EventStream:
    def __init__(self, member: EmbeddedMember) -> None:
        self._member = member

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> BusEvent:
        return await self._member._next_event()


class EmbeddedMember:
    """A member of an embedded bus (see the module docstring)."""

    def __init__(self, stream: trio.SocketStream, me: MemberId, reader: _FrameReader) -> None:
        self.me = me
        self._stream = stream
        self._reader = reader
        self._send_lock = trio.Lock()
        # Events decoded for the application: a deque the reader takes from
        # without a task switch per event, never more than EVENTS_QUEUE_LIMIT.
        self._ready: collections.deque[BusEvent] = collections.deque()
        self._reader_wakeup: trio.Event | None = None
        self._room_wakeup: trio.Event | None = None
        self._ended = False
        self._reads = 0
        self._error: BusError | None = None
        self._leaving = False
        self._queued_max = 0
        self._delivered = 0
        self._multicast = 0
        self._send_waits = 0

    def statistics(self) -> BusStatistics:
        return BusStatistics(
            events_queued=len(self._ready),
            events_queued_max=self._queued_max,
            events_queue_limit=EVENTS_QUEUE_LIMIT,
            delivered=self._delivered,
            multicast=self._multicast,
            send_waits=self._send_waits,
        )

    async def multicast(self, payload: bytes) -> None:
        if self._error is not None:
            raise self._error
        if self._leaving:
            raise BusError(f"member {self.me} has left the bus; it cannot multicast")
        if len(payload) + 1 > MAX_FRAME_BYTES:
            raise BusError(f"payload of {len(payload)} bytes exceeds {MAX_FRAME_BYTES - 1}")
        head = _FRAME_HEAD.pack(len(payload) + 1, MCAST)
        lock = self._send_lock
        try:
            lock.acquire_nowait()  # the common case: no task switch
        except trio.WouldBlock:
            await lock.acquire()
        try:
            try:
                # Small payloads: one buffer, one write; large ones: no copy.
                if len(payload) < 65536:
                    await self._stream.send_all(head + payload)
                else:
                    await self._stream.send_all(head)
                    await self._stream.send_all(payload)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise self._lost(f"send failed: {exc}") from None
        finally:
            lock.release()
        self._multicast += 1

    def events(self) -> AsyncIterator[BusEvent]:
        return _EventStream(self)

    async def leave(self) -> None:
        if self._leaving:
            return
        self._leaving = True
        async with self._send_lock:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await self._stream.send_all(_frame(GOODBYE))

    async def _next_event(self) -> BusEvent:
        ready = self._ready
        while not ready:
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._reader_wakeup = wakeup = trio.Event()
            await wakeup.wait()
        event = ready.popleft()
        if self._room_wakeup is not None and len(ready) <= EVENTS_QUEUE_LIMIT // 2:
            self._room_wakeup.set()
            self._room_wakeup = None
        self._reads += 1
        if self._reads % READS_PER_CHECKPOINT == 0:
            await trio.lowlevel.checkpoint()
        return event

    def _wake_reader(self) -> None:
        wakeup = self._reader_wakeup
        if wakeup is not None:
            self._reader_wakeup = None
            wakeup.set()

    def _lost(self, why: str) -> BusError:
        if self._error is None:
            self._error = BusError(
                f"member {self.me} lost its connection to the embedded sequencer ({why}); "
                "check that `drgate bus` is running and rejoin"
            )
        return self._error

    async def _read_loop(self) -> None:
        ready = self._ready
        reader = self._reader
        try:
            while True:
                room = EVENTS_QUEUE_LIMIT - len(ready)
                if room <= 0:
                    # Full queue: stop reading the socket rather than buffer;
                    # that is what slows the sequencer down.
                    self._send_waits += 1
                    self._room_wakeup = wakeup = trio.Event()
                    await wakeup.wait()
                    continue
                try:
                    frames = reader.buffered_frames_untrusted(room)
                    if not frames:
                        if not await reader.receive_more():
                            if not self._leaving:
                                self._lost("the sequencer closed the connection")
                            return
                        continue
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    if not self._leaving:
                        self._lost(str(exc))
                    return
                except RemoteProtocolError as exc:
                    self._lost(f"bad frame: {exc}")
                    return
                for kind, body in frames:
                    if kind == DELIVER and len(body) >= _IDPAIR.size:
                        sender = MemberId(*_IDPAIR.unpack_from(body))
                        ready.append(Delivery(sender, body[_IDPAIR.size :]))
                        self._delivered += 1
                    elif kind == VIEW:
                        try:
                            ready.append(decode_view_untrusted(body))
                        except RemoteProtocolError as exc:
                            self._lost(f"bad frame: {exc}")
                            return
                    else:
                        self._lost(f"unexpected frame type {kind}")
                        return
                self._queued_max = max(self._queued_max, len(ready))
                self._wake_reader()
        finally:
            self._ended = True
            self._wake_reader()


async def _join(
    stream: trio.SocketStream, reader: _FrameReader, config: BusConfig, key: bytes, role: Role
) -> MemberId:
    """The member's side of the handshake (module docstring): its id once
    the sequencer admitted it and proved it holds ``key``.  Raises BusError."""
    where = f"the sequencer at {config.address}"
    hello = _HELLO.pack(config.node, os.getpid() & 0xFFFFFFFF, int(role))
    hello += new_nonce() + config.group.encode()
    await stream.send_all(_frame(HELLO, hello))
    challenge = await reader.read_frame_untrusted()
    _check_reply(challenge, CHALLENGE, NONCE_BYTES, config, where)
    assert challenge is not None
    transcript = hello + challenge[1]
    await stream.send_all(_frame(PROOF, member_proof(key, transcript)))
    welcome = await reader.read_frame_untrusted()
    _check_reply(welcome, WELCOME, _IDPAIR.size + PROOF_BYTES, config, where)
    assert welcome is not None
    ids, proof = welcome[1][: _IDPAIR.size], welcome[1][_IDPAIR.size :]
    if not proof_matches(sequencer_proof(key, transcript + ids), proof):
        raise BusError(
            f"the process at {config.address} did not prove that it holds the bus key in "
            f"{config.key_file}: it is not the sequencer of this site, or it reads another key; "
            f"check bus.address, and that `drgate bus --key-file` names a copy of {config.key_file}"
        )
    return MemberId(*_IDPAIR.unpack(ids))


def _check_reply(
    reply: tuple[int, bytes] | None, kind: int, size: int, config: BusConfig, where: str
) -> None:
    if reply is None:
        raise BusError(f"{where} closed the connection during the handshake")
    if reply[0] == ERROR:
        text = reply[1].decode("utf-8", "replace")
        if text == REFUSED_KEY:
            raise BusError(
                f"{where} refused this member: it does not hold the site's bus key; "
                f"make bus.key_file ({config.key_file}) a copy of the key file the sequencer "
                "reads (`drgate bus --key-file`)"
            )
        raise BusError(f"{where} refused this member: {text}")
    if reply[0] != kind or len(reply[1]) != size:
        raise BusError(
            f"{where} sent frame type {reply[0]} ({len(reply[1])} bytes) during the handshake; "
            "is bus.address a `drgate bus` sequencer of this version?"
        )


@asynccontextmanager
async def open_embedded_member(config: BusConfig, *, role: Role) -> AsyncIterator[EmbeddedMember]:
    """Join the embedded bus at ``config.address`` with the key in
    ``config.key_file``; leave on exit.  Raises BusError when the key file
    cannot be used, the sequencer cannot be reached, either side's proof does
    not match or the handshake takes longer than ``HELLO_TIMEOUT_S``."""
    if config.address is None:
        raise BusError(
            "the embedded bus needs the sequencer's address; "
            "give the address `drgate bus --listen` printed"
        )
    if config.key_file is None:
        raise BusError(
            f"the embedded bus of group {config.group} needs its key file (bus.key_file); "
            f"{KEYGEN_HINT}"
        )
    key = read_key_file(config.key_file)
    try:
        stream = await trio.open_tcp_stream(config.address.host, config.address.port)
    except OSError as exc:
        raise BusError(
            f"cannot reach the embedded bus sequencer at {config.address} ({exc}); "
            "start it with `drgate bus --listen HOST:PORT --group NAME --key-file FILE`"
        ) from None
    reader = _FrameReader(stream, max_frame=HANDSHAKE_MAX_FRAME_BYTES)
    try:
        with trio.fail_after(HELLO_TIMEOUT_S):
            me = await _join(stream, reader, config, key, role)
        reader.max_frame = MAX_FRAME_BYTES
    except trio.TooSlowError:
        await trio.aclose_forcefully(stream)
        raise BusError(
            f"the sequencer at {config.address} did not finish the handshake within "
            f"{HELLO_TIMEOUT_S:.0f} s; is bus.address a `drgate bus` sequencer?"
        ) from None
    except (OSError, trio.BrokenResourceError, RemoteProtocolError) as exc:
        await trio.aclose_forcefully(stream)
        raise BusError(f"joining the embedded bus at {config.address} failed: {exc}") from None
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    member = EmbeddedMember(stream, me, reader)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(member._read_loop)
            try:
                yield member
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await member.leave()
    finally:
        await trio.aclose_forcefully(stream)
