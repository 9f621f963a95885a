"""The corosync member's send buffer and packing, without a corosync.

``multicast`` queues payloads in a bounded buffer; one flusher task hands
them to corosync in call order, consecutive small ones packed into one CPG
message.  Here libcpg is replaced by a recorder of what would be sent, so
these run anywhere (the contract suite runs the real thing).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import trio
import trio.testing

from cluster.bus import corosync
from cluster.bus.contract import BusConfig
from cluster.bus.corosync import (
    PACK_BYTES,
    PACK_MAX_ITEMS,
    SEND_BUFFER_BYTES,
    CorosyncMember,
    decode_pack,
    encode_pack,
    take_pack,
)
from protocol.errors import BusError


def test_a_pack_round_trips_in_order() -> None:
    items = [b"", b"a", b"x" * 1000, bytes(range(256)) * 3, b""]
    head, body = encode_pack(items)
    assert decode_pack(head + body) == items


def test_take_pack_stops_at_the_byte_limit_and_keeps_the_rest_in_order() -> None:
    outbox = collections.deque(bytes([i]) * 8192 for i in range(20))
    first = take_pack(outbox)
    head, body = encode_pack(first)
    assert len(head) + len(body) <= PACK_BYTES
    assert len(first) == 7  # an eighth 8 KB payload would pass 64 KiB with the heads
    assert [item[0] for item in first] == list(range(7))
    assert [item[0] for item in outbox] == list(range(7, 20))


def test_take_pack_stops_at_the_item_limit() -> None:
    outbox = collections.deque([b"m"] * (PACK_MAX_ITEMS + 5))
    assert len(take_pack(outbox)) == PACK_MAX_ITEMS
    assert len(outbox) == 5


def test_a_payload_larger_than_a_pack_goes_alone() -> None:
    big = b"b" * (PACK_BYTES + 1)
    outbox = collections.deque([big, b"small"])
    assert take_pack(outbox) == [big]
    outbox = collections.deque([b"small", big])
    assert take_pack(outbox) == [b"small"]
    assert list(outbox) == [big]


@pytest.mark.parametrize(
    "message",
    [
        b"\x02\x00\x02\x00\x00\x00\x01\x00\x00\x00\x01a",  # says 2 bytes of payload, has 1
        b"\x02\x00\x01\x00\x00\x00\x01ab",  # one byte too many
        b"\x02\x00\x05\x00\x00",  # lengths cut short
        b"\x01\x00\x00",  # not a pack
    ],
)
def test_a_malformed_pack_is_refused_whole(message: bytes) -> None:
    with pytest.raises(ValueError):
        decode_pack(message)


class _Recorder:
    """Stands in for libcpg: records each CPG message the flusher sends."""

    def __init__(self, member: CorosyncMember) -> None:
        self.member = member
        self.sent: list[bytes] = []
        self.buffered_max = 0
        self.left_with_buffered: int | None = None

    async def mcast(self, head: bytes | None, data: Any, messages: int = 1) -> None:
        self.buffered_max = max(self.buffered_max, self.member._outbox_bytes)
        self.sent.append((head if head is not None else b"\x00") + bytes(data))
        await trio.lowlevel.checkpoint()  # a send lets the other tasks run

    def cpg_leave(self, _handle: int, _name: Any) -> int:
        self.left_with_buffered = len(self.member._outbox)
        return corosync.CS_OK

    def payloads(self) -> list[bytes]:
        out: list[bytes] = []
        for message in self.sent:
            if message[0] == 0:
                out.append(message[1:])
            else:
                out.extend(decode_pack(message))
        return out


@pytest.fixture
def member(monkeypatch: pytest.MonkeyPatch) -> tuple[CorosyncMember, _Recorder]:
    monkeypatch.setattr(corosync, "load_library", lambda _name: None)
    member = CorosyncMember(BusConfig("corosync", "g", 1))
    recorder = _Recorder(member)
    member._cpg = recorder
    member._handle = 1  # "connected"
    monkeypatch.setattr(member, "_mcast", recorder.mcast)
    monkeypatch.setattr(member, "_pump", lambda: None)
    return member, recorder


async def test_payloads_go_out_in_call_order_packed_and_within_the_buffer(
    member: tuple[CorosyncMember, _Recorder],
) -> None:
    bus, recorder = member
    sizes = [8192] * 200 + [100_000, 10] + [300] * 500
    payloads = [i.to_bytes(4, "big") + b"p" * (size - 4) for i, size in enumerate(sizes)]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(bus._flusher)
        for payload in payloads:
            await bus.multicast(payload)
        await bus.leave()
        nursery.cancel_scope.cancel()
    assert recorder.payloads() == payloads
    assert len(recorder.sent) < len(payloads) // 10, "small payloads were packed"
    assert recorder.buffered_max <= SEND_BUFFER_BYTES
    assert recorder.left_with_buffered == 0, "leave() sent the buffer first"


async def test_a_full_buffer_makes_multicast_wait(member: tuple[CorosyncMember, _Recorder]) -> None:
    bus, recorder = member
    # No flusher yet: the buffer fills up and the next multicast must wait.
    count = SEND_BUFFER_BYTES // 8192
    for _ in range(count):
        await bus.multicast(b"f" * 8192)
    blocked = trio.Event()

    async def one_more() -> None:
        await bus.multicast(b"last")
        blocked.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one_more)
        await trio.testing.wait_all_tasks_blocked()
        assert not blocked.is_set(), "multicast waited for room"
        assert bus.statistics().send_waits == 1
        nursery.start_soon(bus._flusher)
        await blocked.wait()
        await bus.leave()
        nursery.cancel_scope.cancel()
    assert recorder.payloads()[-1] == b"last"
    assert len(recorder.payloads()) == count + 1


async def test_a_lost_corosync_ends_the_stream_and_fails_waiting_multicasts(
    member: tuple[CorosyncMember, _Recorder],
) -> None:
    bus, recorder = member
    sends = 0

    async def failing_mcast(head: bytes | None, data: Any, messages: int = 1) -> None:
        nonlocal sends
        sends += 1
        if sends == 3:
            raise bus._lost("cpg_mcast_joined failed with corosync error 2")
        await recorder.mcast(head, data, messages)

    bus._mcast = failing_mcast  # type: ignore[method-assign]
    errors: list[BusError] = []

    async def producer() -> None:
        try:
            for _ in range(10 * SEND_BUFFER_BYTES // 8192):
                await bus.multicast(b"f" * 8192)
        except BusError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(bus._flusher)
        await producer()
        nursery.cancel_scope.cancel()
    assert len(errors) == 1
    assert "lost corosync" in str(errors[0])
    assert bus._ended, "the event stream ends with the error"
    await bus.leave()  # returns: nothing left to wait for
    assert recorder.left_with_buffered == 0


async def test_waiting_multicasts_get_room_in_call_order(
    member: tuple[CorosyncMember, _Recorder],
) -> None:
    bus, recorder = member
    count = SEND_BUFFER_BYTES // 8192
    for _ in range(count):  # no flusher yet: the buffer is full
        await bus.multicast(b"f" * 8192)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bus.multicast, b"a" * 8192)  # waits for room
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(bus.multicast, b"b")  # small enough, but queues behind a
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(bus._flusher)
        nursery.start_soon(bus.multicast, b"c")  # a newcomer once there is room
        await trio.testing.wait_all_tasks_blocked()
        await bus.leave()
        nursery.cancel_scope.cancel()
    assert [p[:1] for p in recorder.payloads()[count:]] == [b"a", b"b", b"c"]
