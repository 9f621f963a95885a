"""Embedded site bus: a sequencer on loopback and members over TCP.

Theory of operation
-------------------
One sequencer process (``drgate bus``) serves one group.  A member connects,
says HELLO (group, node, role) and gets WELCOME with its ``MemberId``
(its node and the sequencer's connection number).  Every connection has a
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
import os
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

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

# --- wire format ------------------------------------------------------------
#
# Every frame:   u32 length (of what follows, big-endian) | u8 type | body
#
# HELLO    c->s  u32 node | u32 pid | u8 role | group (utf-8, rest of frame)
# WELCOME  s->c  u32 node | u32 member number
# MCAST    c->s  payload (rest of frame)
# DELIVER  s->c  u32 sender node | u32 sender number | payload (rest of frame)
# VIEW     s->c  u64 view id | u8 quorate | u16 n members | u16 n joined |
#                u16 n left | (u32 node, u32 number) * (members+joined+left)
# ERROR    s->c  text (utf-8, rest of frame)
# GOODBYE  c->s  (empty)

HELLO, WELCOME, MCAST, DELIVER, VIEW, ERROR, GOODBYE = range(1, 8)
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
HELLO_TIMEOUT_S = 10.0


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

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

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
                if length < 1 or length > MAX_FRAME_BYTES:
                    raise RemoteProtocolError(f"frame length {length} outside 1..{MAX_FRAME_BYTES}")
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
    inbox_queued: int
    inbox_limit: int
    outbox_queued_max: int
    outbox_limit: int


class SequencerServer:
    """The embedded bus engine for one group.  Run with :meth:`serve`."""

    def __init__(self, group: str) -> None:
        self.group = group
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
        reader = _FrameReader(stream)
        try:
            with trio.move_on_after(HELLO_TIMEOUT_S):
                hello = await reader.read_frame_untrusted()
            if hello is None or hello[0] != HELLO or len(hello[1]) < _HELLO.size:
                return
            node, _pid, _role = _HELLO.unpack_from(hello[1])
            group = hello[1][_HELLO.size :].decode("utf-8", "replace")
            if group != self.group:
                text = f"this sequencer serves group {self.group!r}, not {group!r}"
                await stream.send_all(_frame(ERROR, text.encode()))
                return
            conn.member = MemberId(node, conn.number)
            conn.outbox_send, conn.outbox_recv = trio.open_memory_channel[bytes](OUTBOX_LIMIT)
            await stream.send_all(_frame(WELCOME, _IDPAIR.pack(node, conn.number)))
            async with trio.open_nursery() as nursery:
                conn.cancel_scope = nursery.cancel_scope
                nursery.start_soon(self._write_loop, conn)
                await self._inbox_send.send(("join", conn, []))
                with contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError, OSError
                ):
                    # A reset or a bad frame ends this member like an EOF does.
                    await self._read_loop(conn, reader)
                # Stop the writer only once the sequencer has closed our
                # outbox (after the leave): it flushes what is queued.
                await self._inbox_send.send(("leave", conn, []))
        except (trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError, OSError):
            pass
        finally:
            if conn.member is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await self._inbox_send.send(("leave", conn, []))
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await trio.aclose_forcefully(stream)

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


async def serve_sequencer(
    host: str,
    port: int,
    group: str,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an embedded sequencer for ``group`` until cancelled."""
    await SequencerServer(group).serve(host, port, task_status=task_status)


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


@asynccontextmanager
async def open_embedded_member(config: BusConfig, *, role: Role) -> AsyncIterator[EmbeddedMember]:
    """Join the embedded bus at ``config.address``; leave on exit."""
    if config.address is None:
        raise BusError(
            "the embedded bus needs the sequencer's address; "
            "give the address `drgate bus --listen` printed"
        )
    try:
        stream = await trio.open_tcp_stream(config.address.host, config.address.port)
    except OSError as exc:
        raise BusError(
            f"cannot reach the embedded bus sequencer at {config.address} ({exc}); "
            "start it with `drgate bus --listen HOST:PORT --group NAME`"
        ) from None
    reader = _FrameReader(stream)
    try:
        hello = _HELLO.pack(config.node, os.getpid() & 0xFFFFFFFF, int(role))
        await stream.send_all(_frame(HELLO, hello + config.group.encode()))
        with trio.move_on_after(HELLO_TIMEOUT_S):
            reply = await reader.read_frame_untrusted()
            if reply is None:
                raise BusError(f"the sequencer at {config.address} closed the connection")
            if reply[0] == ERROR:
                raise BusError(f"the sequencer at {config.address} refused: {reply[1].decode()}")
            if reply[0] != WELCOME or len(reply[1]) != _IDPAIR.size:
                raise BusError(f"the sequencer at {config.address} sent frame type {reply[0]}")
            me = MemberId(*_IDPAIR.unpack(reply[1]))
        if reply is None:  # pragma: no cover - timed out
            raise BusError(f"the sequencer at {config.address} did not answer HELLO")
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
