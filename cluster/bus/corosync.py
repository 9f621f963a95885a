"""Corosync site bus: CPG (closed process groups) through cffi, ABI mode.

Theory of operation
-------------------
``libcpg.so.4`` does the real work: every member of a CPG group receives the
group's messages and configuration changes in one agreed (total) order, and
a configuration change sits at the same point of every surviving member's
stream (virtual synchrony).  This module only moves data between libcpg and
trio:

* ``multicast`` queues the payload in the member's send buffer (at most
  ``SEND_BUFFER_BYTES``, or one payload of any size) and returns, as a
  socket's send does; it waits only while the buffer is full, and waiting
  callers get room in call order (a ``trio.StrictFIFOLock``).  One flusher
  task hands the buffer to corosync in order: consecutive small payloads go
  out packed as one CPG message (at most ``PACK_BYTES`` and
  ``PACK_MAX_ITEMS``), because each
  ``cpg_mcast_joined`` is a synchronous round trip to corosync and corosync
  spends less CPU per message the more each token rotation carries.  The
  member's own delivery of a message is its confirmation; ``leave`` sends
  what is buffered first.
* ``cpg_dispatch(CS_DISPATCH_ONE_NONBLOCKING)`` runs one callback at a time,
  and only while the member's bounded event queue (a deque, at most
  ``EVENTS_QUEUE_LIMIT`` events) has room: a full queue stops the dispatching
  and corosync holds the messages for us, so the reader sets the pace.  The
  callbacks decode straight into that queue (a pack's payloads past the
  bound wait in order behind it).  Dispatching is a synchronous "pump" run
  by the reader when its queue is empty and by the flusher every
  ``CHECKPOINT_MESSAGES`` payloads or ``CHECKPOINT_BYTES`` sent (a client
  that sends without dispatching makes corosync queue for it).  The reader
  itself waits for the CPG fd (``trio.lowlevel.wait_readable``) when nothing
  is queued, so a wake-up costs one task switch, as a plain libcpg loop costs
  one select(); whoever else queues events (the flusher's pump, the quorum
  loop, the end of the stream) cancels that wait.  The reader takes events
  from the deque without a task switch per event; it yields to the
  scheduler every ``READS_PER_CHECKPOINT`` events.
* ``cpg_mcast_joined`` answering ``CS_ERR_TRY_AGAIN`` is backpressure: the
  flusher dispatches what it can, sleeps a short, growing while (0.5 ms to
  20 ms; the reader keeps running meanwhile) and tries again.  It is never
  an error and never a busy loop; the buffer fills and ``multicast`` waits.
* Payloads above ``CHUNK_BYTES`` are split into chunks: libcpg would fragment
  them itself, but its fragmentation blocks the calling thread until the whole
  message is through.  Each CPG message starts with one kind byte::

      WHOLE  0x00 | payload
      CHUNK  0x01 | u64 message number | u32 index | u32 count | data
      PACK   0x02 | u16 count | u32 length * count | the payloads, in order

  A chunked message takes its place in the stream where its *first* chunk is
  delivered; what follows waits behind it until its last chunk is in.  So a
  member that joins in the middle of a chunked message (and lacks its first
  chunk) is exactly a member that joined after that message: it drops the
  rest, while older members deliver it before the join.  Partial messages of
  a sender that leaves are dropped by every member at the same point.  A
  pack is one CPG message, so its payloads are delivered together, at one
  point of every member's stream.
* Quorum comes from corosync's quorum service (libquorum): every view change
  carries ``quorum_getquorate`` as read when the configuration change is
  processed (corosync settles quorum before CPG reports a new configuration);
  a quorum change without a membership change is reported as a view change
  with nothing joined or left.  That one is local: other members see theirs
  at their own points.
* A lost connection to corosync (dispatch or multicast failing) ends the
  event stream with ``BusError``, and ``multicast`` raises it; what was
  still buffered is lost with the member, as corosync loses what it had
  accepted from a node that fails.

One member per process per group: CPG names a member by (nodeid, pid).
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import itertools
import os
import struct
import termios
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from cffi import FFI

from cluster.bus.contract import (
    BusConfig,
    BusEvent,
    BusStatistics,
    Delivery,
    MemberId,
    ViewChange,
)
from protocol.errors import BusError
from protocol.modes import Role

CDEF = """
typedef uint64_t cpg_handle_t;
typedef int cs_error_t;
typedef int cs_dispatch_flags_t;
typedef int cpg_guarantee_t;
struct cpg_address { uint32_t nodeid; uint32_t pid; uint32_t reason; };
struct cpg_name { uint32_t length; char value[128]; };
struct iovec { void *iov_base; size_t iov_len; };
typedef void (*cpg_deliver_fn_t)(cpg_handle_t handle, const struct cpg_name *group_name,
    uint32_t nodeid, uint32_t pid, void *msg, size_t msg_len);
typedef void (*cpg_confchg_fn_t)(cpg_handle_t handle, const struct cpg_name *group_name,
    const struct cpg_address *member_list, size_t member_list_entries,
    const struct cpg_address *left_list, size_t left_list_entries,
    const struct cpg_address *joined_list, size_t joined_list_entries);
typedef struct { cpg_deliver_fn_t cpg_deliver_fn; cpg_confchg_fn_t cpg_confchg_fn; }
    cpg_callbacks_t;
cs_error_t cpg_initialize(cpg_handle_t *handle, cpg_callbacks_t *callbacks);
cs_error_t cpg_finalize(cpg_handle_t handle);
cs_error_t cpg_fd_get(cpg_handle_t handle, int *fd);
cs_error_t cpg_max_atomic_msgsize_get(cpg_handle_t handle, uint32_t *size);
cs_error_t cpg_dispatch(cpg_handle_t handle, cs_dispatch_flags_t dispatch_types);
cs_error_t cpg_join(cpg_handle_t handle, const struct cpg_name *group);
cs_error_t cpg_leave(cpg_handle_t handle, const struct cpg_name *group);
cs_error_t cpg_mcast_joined(cpg_handle_t handle, cpg_guarantee_t guarantee,
    const struct iovec *iovec, unsigned int iov_len);
cs_error_t cpg_local_get(cpg_handle_t handle, unsigned int *local_nodeid);

typedef uint64_t quorum_handle_t;
typedef void (*quorum_notification_fn_t)(quorum_handle_t handle, uint32_t quorate,
    uint64_t ring_seq, uint32_t view_list_entries, uint32_t *view_list);
typedef struct { quorum_notification_fn_t quorum_notify_fn; } quorum_callbacks_t;
cs_error_t quorum_initialize(quorum_handle_t *handle, quorum_callbacks_t *callbacks,
    uint32_t *quorum_type);
cs_error_t quorum_finalize(quorum_handle_t handle);
cs_error_t quorum_fd_get(quorum_handle_t handle, int *fd);
cs_error_t quorum_dispatch(quorum_handle_t handle, cs_dispatch_flags_t dispatch_types);
cs_error_t quorum_getquorate(quorum_handle_t handle, int *quorate);
cs_error_t quorum_trackstart(quorum_handle_t handle, unsigned int flags);
"""

CS_OK = 1
CS_ERR_TRY_AGAIN = 6
CS_DISPATCH_ALL = 2
CS_DISPATCH_ONE_NONBLOCKING = 4
CS_TRACK_CHANGES = 0x02
CPG_TYPE_AGREED = 2
CPG_MAX_NAME_LENGTH = 128

ffi = FFI()
ffi.cdef(CDEF)
_libs: dict[str, Any] = {}


def load_library(name: str) -> Any:
    """``dlopen`` a corosync client library once; ``BusError`` when it is missing."""
    if name not in _libs:
        try:
            _libs[name] = ffi.dlopen(name)
        except OSError as exc:
            raise BusError(
                f"cannot load {name} ({exc}); install the Debian package corosync"
            ) from None
    return _libs[name]


# Chunks stay well below CPG's atomic message size (about 1 MB here): one
# chunk is one IPC request that never blocks on libcpg's own fragmentation,
# and a 5 MB payload is 20 chunks.  Measured in bench/bus_bench.py.
CHUNK_BYTES = 256 * 1024
# Events decoded but not yet read by the application.  When it is full the
# dispatching stops and corosync holds the rest for us.
EVENTS_QUEUE_LIMIT = 128
# Multicasts wait in a member's send buffer (at most SEND_BUFFER_BYTES, or
# one payload of any size) until its flusher hands them to corosync; the
# flusher packs consecutive small ones into one CPG message of at most
# PACK_BYTES and PACK_MAX_ITEMS payloads.  One cpg_mcast_joined is one
# synchronous round trip to corosync, and corosync spends less CPU per
# message the more each token rotation carries: measured in bench/bus_bench.py.
PACK_BYTES = 64 * 1024
PACK_MAX_ITEMS = 64
SEND_BUFFER_BYTES = 16 * PACK_BYTES
# The flusher dispatches (its own messages among what came) and yields to
# the scheduler after this many payloads or bytes sent: well within the event
# queue, so the reader keeps up with what the member sends itself.
CHECKPOINT_MESSAGES = EVENTS_QUEUE_LIMIT // 4
CHECKPOINT_BYTES = 1024 * 1024
# Events read between two yields to the scheduler.
READS_PER_CHECKPOINT = 32
# Backpressure waits after CS_ERR_TRY_AGAIN: short first, growing, capped.
TRY_AGAIN_FIRST_S = 0.0005
TRY_AGAIN_MAX_S = 0.02
# A member that cannot get a call through for this long has lost corosync.
TRY_AGAIN_GIVE_UP_S = 60.0

_WHOLE = b"\x00"
_CHUNK_KIND = 1
_CHUNK = struct.Struct(">BQII")  # kind, message number, index, count
_PACK_KIND = 2
_PACK = struct.Struct(">BH")  # kind, payload count; then a u32 length per payload

# Callbacks receive only the handle: it leads back to the member.
_members_by_handle: dict[int, CorosyncMember] = {}
_quorum_by_handle: dict[int, CorosyncMember] = {}


def _on_deliver(handle: int, _group: Any, nodeid: int, pid: int, msg: Any, size: int) -> None:
    member = _members_by_handle.get(handle)
    if member is None or size < 1:
        return
    try:
        data = ffi.buffer(msg, size)
        sender = member._ids.get((nodeid, pid))
        if sender is None:
            sender = member._ids[(nodeid, pid)] = MemberId(nodeid, pid)
        kind = data[0]
        if kind == _WHOLE:
            member._delivered += 1
            member._queue(Delivery(sender, data[1:]))  # the one copy out of libcpg
        elif kind == b"\x02" and size >= _PACK.size:
            with contextlib.suppress(ValueError):  # not ours (see below)
                member._unpack(sender, data)
        elif kind == b"\x01" and size >= _CHUNK.size:
            member._chunk(sender, data[:])
        # Anything else is not ours (a foreign CPG client in our group): skipped.
    except BaseException as exc:  # never unwind through libcpg
        member._callback_error = exc


def _on_confchg(
    handle: int,
    _group: Any,
    members: Any,
    n_members: int,
    left: Any,
    n_left: int,
    joined: Any,
    n_joined: int,
) -> None:
    member = _members_by_handle.get(handle)
    if member is None:
        return

    def ids(array: Any, count: int) -> tuple[MemberId, ...]:
        return tuple(sorted(MemberId(array[i].nodeid, array[i].pid) for i in range(count)))

    try:
        member._configuration_change(
            ids(members, n_members), ids(joined, n_joined), ids(left, n_left)
        )
    except BaseException as exc:  # never unwind through libcpg
        member._callback_error = exc


def _on_quorum(handle: int, quorate: int, _seq: int, _n: int, _nodes: Any) -> None:
    member = _quorum_by_handle.get(handle)
    if member is not None:
        member._quorum_notified = bool(quorate)


_deliver_callback = ffi.callback("cpg_deliver_fn_t", _on_deliver)
_confchg_callback = ffi.callback("cpg_confchg_fn_t", _on_confchg)
_quorum_callback = ffi.callback("quorum_notification_fn_t", _on_quorum)


def take_pack(outbox: collections.deque[bytes]) -> list[bytes]:
    """Take the next payloads from ``outbox`` that go out as one CPG message.

    Consecutive payloads while they fit in ``PACK_BYTES`` (with their length
    words) and number at most ``PACK_MAX_ITEMS``; a payload larger than a
    pack goes alone.  ``outbox`` must not be empty.
    """
    first = outbox.popleft()
    items = [first]
    size = _PACK.size + 4 + len(first)
    if size > PACK_BYTES:
        return items
    while outbox and len(items) < PACK_MAX_ITEMS:
        size += 4 + len(outbox[0])
        if size > PACK_BYTES:
            break
        items.append(outbox.popleft())
    return items


def encode_pack(items: list[bytes]) -> tuple[bytes, bytes]:
    """A packed CPG message for ``items``: its head (kind, count, lengths) and body."""
    count = len(items)
    head = _PACK.pack(_PACK_KIND, count) + struct.pack(f">{count}I", *map(len, items))
    return head, b"".join(items)


def decode_pack(data: Any) -> list[bytes]:
    """The payloads of a packed CPG message (``data``: the whole message).

    Raises ``ValueError`` when the lengths do not add up to the message (not
    something ``encode_pack`` made).
    """
    try:
        kind, count = _PACK.unpack_from(data)
        lengths = struct.unpack_from(f">{count}I", data, _PACK.size)
    except struct.error as exc:
        raise ValueError(f"pack head cut short ({exc})") from None
    if kind != _PACK_KIND:
        raise ValueError(f"kind {kind} is not a pack")
    offset = _PACK.size + 4 * count
    if offset + sum(lengths) != len(data):
        raise ValueError(f"pack of {count} payloads does not add up to {len(data)} bytes")
    payloads = []
    for length in lengths:
        payloads.append(data[offset : offset + length])
        offset += length
    return payloads


def _check(rc: int, what: str) -> None:
    if rc != CS_OK:
        raise BusError(f"{what} failed with corosync error {rc}; is corosync running on this node?")


@dataclass(eq=False)
class _Slot:
    """A place in the delivery order; ``event`` is None while chunks are missing."""

    event: BusEvent | None
    chunks: list[bytes] | None = None
    dropped: bool = False


class _EventStream:
    def __init__(self, member: CorosyncMember) -> None:
        self._member = member

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> BusEvent:
        member = self._member
        if member._ready and not member._pending and member._reads_left > 1:
            # The common case, without a second coroutine: an event is here.
            member._reads_left -= 1
            return member._ready.popleft()
        return await member._next_event()


class CorosyncMember:
    """A member of a CPG group (see the module docstring)."""

    def __init__(self, config: BusConfig) -> None:
        self._config = config
        self._cpg = load_library("libcpg.so.4")
        self._quorum_lib = load_library("libquorum.so.5")
        # Events ready for the reader, in order; never more than EVENTS_QUEUE_LIMIT.
        self._ready: collections.deque[BusEvent] = collections.deque()
        # Events behind a chunked message whose chunks are still missing (or
        # behind a full ready queue); moved to _ready in order by _flush.
        self._pending: collections.deque[_Slot] = collections.deque()
        self._partials: dict[tuple[MemberId, int], _Slot] = {}
        self._partial_bytes = 0
        self._ids: dict[tuple[int, int], MemberId] = {}
        self._numbers = itertools.count(1)
        # The reader's wait on the CPG fd, while its queue is empty; cancelled
        # by whoever else puts events in the queue (the sender's pump, the
        # quorum loop, the end of the stream).
        self._reader_wait: trio.CancelScope | None = None
        self._ended = False  # no more events will be added (error or left)
        self._callback_error: BaseException | None = None
        # The send buffer: payloads multicast but not yet handed to corosync,
        # in call order, and their total size.  Only the flusher task sends.
        self._outbox: collections.deque[bytes] = collections.deque()
        self._outbox_bytes = 0
        self._flusher_idle = trio.lowlevel.ParkingLot()  # the flusher, waiting for work
        self._room = trio.lowlevel.ParkingLot()  # a multicast, waiting for room
        self._drained = trio.lowlevel.ParkingLot()  # leave(), waiting for an empty buffer
        self._flushing = False  # the flusher holds payloads taken from the outbox
        # Multicasts that must wait for room queue for it in call order, so a
        # member's own messages keep their order: the lock passes straight to
        # the longest waiter, and a newcomer that finds it held queues too.
        self._send_turn = trio.StrictFIFOLock()
        self._error: BusError | None = None
        self._leaving = False
        self._left = False
        self._view_id = 0
        self._members: tuple[MemberId, ...] = ()
        self._quorate_reported: bool | None = None
        self._quorum_notified: bool | None = None
        self._queued_max = 0
        self._delivered = 0
        self._multicast = 0
        self._send_waits = 0
        self._sent_messages = 0  # payloads sent since the flusher last yielded
        self._sent_bytes = 0
        self._reads_left = READS_PER_CHECKPOINT  # reads until the next checkpoint
        self._handle = 0
        self._quorum_handle = 0
        self._fd = -1
        self._quorum_fd = -1
        self._available = array.array("i", [0])
        name = config.group.encode()
        if len(name) > CPG_MAX_NAME_LENGTH:
            raise BusError(f"group name {config.group!r} is longer than 128 bytes")
        self._name = ffi.new("struct cpg_name *")
        self._name.length = len(name)
        ffi.memmove(self._name.value, name, len(name))
        # One iovec pair per member, reused by every send: [kind byte | data].
        self._iov = ffi.new("struct iovec[2]")
        self._whole_head = ffi.new("char[1]", _WHOLE)
        self.me = MemberId(config.node, os.getpid())

    # -- lifecycle -----------------------------------------------------------------

    def _connect(self) -> None:
        handle = ffi.new("cpg_handle_t *")
        callbacks = ffi.new("cpg_callbacks_t *")
        callbacks.cpg_deliver_fn = _deliver_callback
        callbacks.cpg_confchg_fn = _confchg_callback
        _check(self._cpg.cpg_initialize(handle, callbacks), "cpg_initialize")
        self._handle = int(handle[0])
        _members_by_handle[self._handle] = self
        nodeid = ffi.new("unsigned int *")
        _check(self._cpg.cpg_local_get(self._handle, nodeid), "cpg_local_get")
        if nodeid[0] != self._config.node:
            raise BusError(
                f"this node's corosync nodeid is {nodeid[0]} but the bus config says node "
                f"{self._config.node}; fix the config's node id or the corosync nodelist"
            )
        fd = ffi.new("int *")
        _check(self._cpg.cpg_fd_get(self._handle, fd), "cpg_fd_get")
        self._fd = fd[0]

        qhandle = ffi.new("quorum_handle_t *")
        qcallbacks = ffi.new("quorum_callbacks_t *")
        qcallbacks.quorum_notify_fn = _quorum_callback
        qtype = ffi.new("uint32_t *")
        _check(self._quorum_lib.quorum_initialize(qhandle, qcallbacks, qtype), "quorum_initialize")
        self._quorum_handle = int(qhandle[0])
        _quorum_by_handle[self._quorum_handle] = self
        _check(
            self._quorum_lib.quorum_trackstart(self._quorum_handle, CS_TRACK_CHANGES),
            "quorum_trackstart",
        )
        _check(self._quorum_lib.quorum_fd_get(self._quorum_handle, fd), "quorum_fd_get")
        self._quorum_fd = fd[0]

    async def _join(self) -> None:
        backoff = TRY_AGAIN_FIRST_S
        with trio.fail_after(TRY_AGAIN_GIVE_UP_S):
            while (rc := self._cpg.cpg_join(self._handle, self._name)) == CS_ERR_TRY_AGAIN:
                await trio.sleep(backoff)
                backoff = min(backoff * 2, TRY_AGAIN_MAX_S)
        _check(rc, f"cpg_join of group {self._config.group!r}")

    def _finalize(self) -> None:
        if self._fd >= 0:
            trio.lowlevel.notify_closing(self._fd)  # a reader waiting on it wakes
        if self._handle:
            self._cpg.cpg_finalize(self._handle)
            _members_by_handle.pop(self._handle, None)
            self._handle = 0
        if self._quorum_handle:
            self._quorum_lib.quorum_finalize(self._quorum_handle)
            _quorum_by_handle.pop(self._quorum_handle, None)
            self._quorum_handle = 0
        self._end()

    # -- public API ------------------------------------------------------------------

    def statistics(self) -> BusStatistics:
        return BusStatistics(
            events_queued=len(self._ready),
            events_queued_max=self._queued_max,
            events_queue_limit=EVENTS_QUEUE_LIMIT,
            delivered=self._delivered,
            multicast=self._multicast,
            send_waits=self._send_waits,
            pending_reassembly_bytes=self._partial_bytes,
        )

    async def multicast(self, payload: bytes) -> None:
        """Queue ``payload`` in the send buffer; waits while the buffer is full.

        Like a socket's send: it returns once the message is queued, and the
        member's own delivery of it is the confirmation that it went out.
        """
        if self._error is not None:
            raise self._error
        if self._leaving:
            raise BusError(f"member {self.me} has left group {self._config.group!r}")
        turn = self._send_turn
        if turn.locked() or not self._has_room(len(payload)):
            # Wait for room behind the multicasts already waiting.
            async with turn:
                while True:
                    if self._error is not None:
                        raise self._error
                    if self._has_room(len(payload)):
                        break
                    self._send_waits += 1  # backpressure: the buffer is full
                    await self._room.park()
        self._outbox.append(payload)
        self._outbox_bytes += len(payload)
        self._multicast += 1
        if self._flusher_idle:
            self._flusher_idle.unpark()

    def _has_room(self, size: int) -> bool:
        # A payload larger than the whole buffer goes alone.
        return not self._outbox or self._outbox_bytes + size <= SEND_BUFFER_BYTES

    def events(self) -> AsyncIterator[BusEvent]:
        return _EventStream(self)

    async def leave(self) -> None:
        """Send what the buffer holds, then leave the group."""
        if self._leaving or not self._handle:
            return
        self._leaving = True
        while (self._outbox or self._flushing) and self._error is None:
            await self._drained.park()
        if self._handle:
            self._cpg.cpg_leave(self._handle, self._name)

    def _abandon(self) -> None:
        """Leave at once (the member's scope ended abnormally): the buffer is dropped."""
        self._leaving = True
        self._drop_outbox()
        if self._handle:
            self._cpg.cpg_leave(self._handle, self._name)

    # -- sending ---------------------------------------------------------------------

    async def _flusher(self) -> None:
        """Hand the send buffer to corosync, in order, packing small payloads."""
        outbox = self._outbox
        try:
            while True:
                while not outbox:
                    if self._drained:
                        self._drained.unpark_all()
                    await self._flusher_idle.park()
                self._flushing = True
                while outbox:
                    items = take_pack(outbox)
                    if len(items) > 1:
                        await self._send_pack(items)
                    else:
                        await self._send_one(items[0])
                    self._outbox_bytes -= sum(len(item) for item in items)
                    if self._room:
                        self._room.unpark_all()
                self._flushing = False
        except BusError:
            # The member lost corosync (_mcast set the error): the stream ends
            # with it, and waiting multicasts and leave() see it.
            self._drop_outbox()
            self._end()
            self._room.unpark_all()
            self._drained.unpark_all()

    def _drop_outbox(self) -> None:
        self._outbox.clear()
        self._outbox_bytes = 0
        self._flushing = False

    async def _send_pack(self, items: list[bytes]) -> None:
        head, body = encode_pack(items)
        await self._mcast(head, body, len(items))

    async def _send_one(self, payload: bytes) -> None:
        if len(payload) <= CHUNK_BYTES:
            await self._mcast(None, payload)
            return
        number = next(self._numbers)
        view = memoryview(payload)
        count = (len(payload) + CHUNK_BYTES - 1) // CHUNK_BYTES
        for index in range(count):
            head = _CHUNK.pack(_CHUNK_KIND, number, index, count)
            await self._mcast(head, view[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES])

    async def _mcast(self, head: bytes | None, data: bytes | memoryview, messages: int = 1) -> None:
        iov = self._iov
        head_buffer = None
        if head is None:
            iov[0].iov_base = self._whole_head
            iov[0].iov_len = 1
        else:
            head_buffer = ffi.from_buffer(head)
            iov[0].iov_base = head_buffer
            iov[0].iov_len = len(head)
        data_buffer = ffi.from_buffer(data)
        iov[1].iov_base = data_buffer
        iov[1].iov_len = len(data)
        mcast = self._cpg.cpg_mcast_joined
        backoff = TRY_AGAIN_FIRST_S
        waited = 0.0
        while True:
            if not self._handle:
                raise self._lost("the member is closed")
            rc = mcast(self._handle, CPG_TYPE_AGREED, iov, 2)
            if rc == CS_OK:
                break
            if rc != CS_ERR_TRY_AGAIN:
                raise self._lost(f"cpg_mcast_joined failed with corosync error {rc}")
            # Backpressure: corosync's queues are full.  Dispatch what we can
            # (our own unread messages may be what holds it up), then wait,
            # growing; the reader runs meanwhile.
            self._send_waits += 1
            if waited > TRY_AGAIN_GIVE_UP_S:
                raise self._lost(f"corosync refused to send for {waited:.0f} s")
            self._pump()
            await trio.sleep(backoff)
            waited += backoff
            backoff = min(backoff * 2, TRY_AGAIN_MAX_S)
        del head_buffer, data_buffer  # the iovec pointed into them until here
        self._sent_messages += messages
        self._sent_bytes += len(data)
        if self._sent_messages >= CHECKPOINT_MESSAGES or self._sent_bytes >= CHECKPOINT_BYTES:
            # Dispatch what came meanwhile (our own messages among it: a
            # member that sends without dispatching makes corosync queue for
            # it and then refuse it), then let the reader and the other
            # tasks run.
            self._sent_messages = self._sent_bytes = 0
            self._pump()
            await trio.lowlevel.checkpoint()

    # -- receiving -------------------------------------------------------------------

    def _lost(self, why: str) -> BusError:
        if self._error is None:
            self._error = BusError(
                f"member {self.me} of group {self._config.group!r} lost corosync ({why}); "
                "check `corosync-quorumtool -s` on this node and rejoin"
            )
        return self._error

    def _end(self) -> None:
        """No more events will come: wake the reader so it ends the stream."""
        self._ended = True
        self._wake_reader()

    def _wake_reader(self) -> None:
        scope = self._reader_wait
        if scope is not None:
            self._reader_wait = None
            scope.cancel()

    def _pump(self) -> None:
        """Dispatch what libcpg holds for us, as far as the event queue has room.

        Synchronous: the callbacks put events straight into the queue, and
        nothing else runs meanwhile.  Never more than the room left is
        dispatched, so the queue stays within its bound.
        """
        if self._ended or not self._handle:
            return
        ready = self._ready
        if len(ready) >= EVENTS_QUEUE_LIMIT:
            return
        # libqb writes one notification byte to the CPG fd per event, after
        # the event itself: the bytes waiting tell how many events can be
        # dispatched now without blocking and without a call that finds none.
        try:
            fcntl.ioctl(self._fd, termios.FIONREAD, self._available)
        except OSError as exc:
            self._lost(f"the CPG connection is gone ({exc})")
            self._end()
            return
        available = self._available[0]
        if available <= 0:
            return
        dispatch = self._cpg.cpg_dispatch
        handle = self._handle
        before = len(ready)
        for _ in range(available):
            if len(ready) >= EVENTS_QUEUE_LIMIT:
                # libcpg holds more than the queue takes: the bus waits for
                # the reader (backpressure), and keeps the rest meanwhile.
                self._send_waits += 1
                break
            rc = dispatch(handle, CS_DISPATCH_ONE_NONBLOCKING)
            if rc != CS_OK:
                if rc != CS_ERR_TRY_AGAIN:
                    self._lost(f"cpg_dispatch failed with corosync error {rc}")
                    self._end()
                break
            if self._left:
                break
        if self._callback_error is not None:
            error, self._callback_error = self._callback_error, None
            raise error
        if self._pending:
            self._flush()
        queued = len(ready)
        self._queued_max = max(self._queued_max, queued)
        if queued > before:
            self._wake_reader()
        if self._left:
            self._end()

    async def _next_event(self) -> BusEvent:
        ready = self._ready
        if not ready:
            self._pump()  # no wait when libcpg already has something
        while not ready:
            if self._ended:
                self._flush()
                if ready:
                    break
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            # The reader itself waits for the CPG fd: one task switch per
            # wake-up, as a plain libcpg loop has one select().
            with trio.CancelScope() as scope:
                self._reader_wait = scope
                try:
                    await trio.lowlevel.wait_readable(self._fd)
                except trio.ClosedResourceError:
                    self._end()  # the member was finalized under us
                finally:
                    self._reader_wait = None
            self._pump()
        event = ready.popleft()
        if self._pending:
            self._flush()
        self._reads_left -= 1
        if self._reads_left <= 0:
            self._reads_left = READS_PER_CHECKPOINT
            await trio.lowlevel.checkpoint()
        return event

    async def _quorum_loop(self) -> None:
        while True:
            await trio.lowlevel.wait_readable(self._quorum_fd)
            rc = self._quorum_lib.quorum_dispatch(self._quorum_handle, CS_DISPATCH_ALL)
            if rc != CS_OK:
                self._lost(f"quorum_dispatch failed with corosync error {rc}")
                self._end()
                return
            notified = self._quorum_notified
            if (
                notified is not None
                and self._quorate_reported is not None
                and notified != self._quorate_reported
                and not self._left
            ):
                self._quorate_reported = notified
                self._view_id += 1
                view = ViewChange(self._view_id, self._members, (), (), notified)
                self._pending.append(_Slot(view))
                self._flush()
                self._wake_reader()

    def _quorate(self) -> bool:
        quorate = ffi.new("int *")
        rc = self._quorum_lib.quorum_getquorate(self._quorum_handle, quorate)
        if rc != CS_OK:
            raise self._lost(f"quorum_getquorate failed with corosync error {rc}")
        return bool(quorate[0])

    def _unpack(self, sender: MemberId, data: Any) -> None:
        """A packed CPG message: its payloads are delivered one by one, in order."""
        payloads = decode_pack(data)
        self._delivered += len(payloads)
        for payload in payloads:
            self._queue(Delivery(sender, payload))

    def _queue(self, event: BusEvent) -> None:
        """Put ``event`` next in the stream, as the callbacks decode it.

        It goes behind whatever waits in ``_pending`` (a chunked message still
        missing chunks, or a pack's payloads past the queue's bound: at most
        one pack's worth, since the pump dispatches nothing while the queue is
        full); ``_flush`` moves those on in order as the reader makes room.
        """
        if self._pending or len(self._ready) >= EVENTS_QUEUE_LIMIT:
            self._pending.append(_Slot(event))
        else:
            self._ready.append(event)

    def _chunk(self, sender: MemberId, message: bytes) -> None:
        _kind, number, index, count = _CHUNK.unpack_from(message)
        data = message[_CHUNK.size :]
        key = (sender, number)
        slot: _Slot | None
        if index == 0:
            slot = _Slot(None, [data])
            self._pending.append(slot)
            self._partials[key] = slot
            self._partial_bytes += len(data)
        else:
            slot = self._partials.get(key)
            if slot is None or slot.chunks is None or len(slot.chunks) != index:
                return  # we joined after its first chunk: it precedes our view
            slot.chunks.append(data)
            self._partial_bytes += len(data)
        if index == count - 1:
            assert slot is not None
            assert slot.chunks is not None
            self._partial_bytes -= sum(len(c) for c in slot.chunks)
            slot.event = Delivery(sender, b"".join(slot.chunks))
            slot.chunks = None
            self._delivered += 1
            del self._partials[key]

    def _configuration_change(
        self,
        members: tuple[MemberId, ...],
        joined: tuple[MemberId, ...],
        left: tuple[MemberId, ...],
    ) -> None:
        gone = set(left)
        for key in [k for k in self._partials if k[0] in gone]:
            slot = self._partials.pop(key)
            slot.dropped = True
            self._partial_bytes -= sum(len(c) for c in slot.chunks or ())
        if not self._members and self.me not in joined:
            # libcpg reports our pid as corosync sees it: trust the first view.
            mine = [m for m in joined if m.node == self._config.node]
            if len(mine) == 1:
                self.me = mine[0]
        quorate = self._quorate()
        self._quorate_reported = quorate
        self._members = members
        self._view_id += 1
        self._queue(ViewChange(self._view_id, members, joined, left, quorate))
        if self.me in left:
            self._left = True

    def _flush(self) -> None:
        """Move ready slots, in order, from ``_pending`` to the event queue."""
        pending = self._pending
        ready = self._ready
        while pending and len(ready) < EVENTS_QUEUE_LIMIT:
            slot = pending[0]
            if slot.dropped:
                pending.popleft()
            elif slot.event is not None:
                pending.popleft()
                ready.append(slot.event)
            else:
                break
        self._queued_max = max(self._queued_max, len(ready))


@asynccontextmanager
async def open_corosync_member(config: BusConfig, *, role: Role) -> AsyncIterator[CorosyncMember]:
    """Join ``config.group`` through this node's corosync; leave on exit."""
    del role  # roles are announced by the application, not the bus
    member = CorosyncMember(config)
    try:
        member._connect()
        await member._join()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(member._quorum_loop)
            nursery.start_soon(member._flusher)
            try:
                yield member
            except BaseException:
                member._abandon()
                raise
            else:
                await member.leave()  # sends what is still buffered first
            finally:
                nursery.cancel_scope.cancel()
    finally:
        member._finalize()
