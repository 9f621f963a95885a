"""The WAN emulator (lab/wan.py) in front of an echo server, over loopback.

Delays and rates are asserted on the proxy's own recorded schedule (arrival,
release, permit times on trio's clock), plus lower bounds on elapsed time,
which cannot flake on a slow machine.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import trio

from lab.wan import Direction, WanEmulator, apply_command, send_control, serve_wan

pytestmark = pytest.mark.integration


async def _echo(stream: trio.SocketStream) -> None:
    async with stream:
        try:
            while data := await stream.receive_some(65536):
                await stream.send_all(data)
        except trio.BrokenResourceError:
            pass


async def start_echo(nursery: trio.Nursery) -> tuple[str, int]:
    listeners = await nursery.start(functools.partial(trio.serve_tcp, _echo, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[:2]


async def start_wan(nursery: trio.Nursery, **kwargs: object) -> WanEmulator:
    target = await start_echo(nursery)
    wan: WanEmulator = await nursery.start(
        functools.partial(serve_wan, ("127.0.0.1", 0), target, **kwargs)
    )
    return wan


async def receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = await stream.receive_some(n - len(buf))
        if not data:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


async def connect(wan: WanEmulator) -> trio.SocketStream:
    assert wan.address is not None
    return await trio.open_tcp_stream(*wan.address)


async def assert_closed(stream: trio.SocketStream) -> None:
    """The stream is reset or at EOF (within a deadline)."""
    with trio.fail_after(30):
        try:
            await stream.send_all(b"ping")
            data = await stream.receive_some(100)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        assert data == b""


async def test_bytes_arrive_intact_and_in_order() -> None:
    payload = os.urandom(2_000_000)
    async with trio.open_nursery() as nursery:
        wan = await start_wan(nursery, delay_ms=2, jitter_ms=2, seed=1)
        with trio.fail_after(20):
            async with await connect(wan) as s, trio.open_nursery() as inner:

                async def send() -> None:
                    for i in range(0, len(payload), 30_000):
                        await s.send_all(payload[i : i + 30_000])

                inner.start_soon(send)
                assert await receive_exactly(s, len(payload)) == payload
        stats = wan.statistics()
        assert stats["bytes_up"] == stats["bytes_down"] == len(payload)
        nursery.cancel_scope.cancel()


async def test_delay_and_jitter_schedule() -> None:
    delay, jitter = 30.0, 10.0
    async with trio.open_nursery() as nursery:
        wan = await start_wan(nursery, delay_ms=delay, jitter_ms=jitter, seed=7)
        with trio.fail_after(10):
            async with await connect(wan) as s:
                for i in range(10):
                    start = trio.current_time()
                    await s.send_all(b"m%03d" % i)
                    assert await receive_exactly(s, 4) == b"m%03d" % i
                    # a round trip crosses the delay twice
                    assert trio.current_time() - start >= 2 * (delay - jitter) / 1000
        for d in Direction:
            pieces = [p for p in wan.records if p.direction is d]
            assert len(pieces) >= 10
            releases = [p.release for p in pieces]
            assert releases == sorted(releases)  # monotonic: TCP order kept
            for p in pieces:
                assert p.release - p.arrival >= (delay - jitter) / 1000 - 1e-9
                assert p.permit >= p.release
            # jitter bound holds where the monotonic raise did not apply
            assert any(p.release - p.arrival <= (delay + jitter) / 1000 + 1e-9 for p in pieces)
        nursery.cancel_scope.cancel()


async def test_cut_resets_connections_and_refuses_new_ones_until_restore() -> None:
    async with trio.open_nursery() as nursery:
        wan = await start_wan(nursery)
        with trio.fail_after(10):
            s = await connect(wan)
            await s.send_all(b"hello")
            assert await receive_exactly(s, 5) == b"hello"
            wan.cut()
            await assert_closed(s)
            await s.aclose()
            for _ in range(3):
                t = await connect(wan)
                await assert_closed(t)
                await t.aclose()
            assert wan.statistics()["refused"] == 3
            wan.restore()
            async with await connect(wan) as u:
                await u.send_all(b"again")
                assert await receive_exactly(u, 5) == b"again"
        nursery.cancel_scope.cancel()


async def test_cut_blackhole_holds_new_connections_silent() -> None:
    async with trio.open_nursery() as nursery:
        wan = await start_wan(nursery)
        wan.cut(blackhole=True)
        with trio.fail_after(10):
            t = await connect(wan)
            await t.send_all(b"anyone?")
            with trio.move_on_after(0.3) as quiet:
                await t.receive_some(100)
            assert quiet.cancelled_caught  # neither data nor EOF: a black hole
            wan.restore()
            await assert_closed(t)  # held connections are dropped at restore
            await t.aclose()
        nursery.cancel_scope.cancel()


async def test_stall_forwards_nothing_then_everything_after_restore() -> None:
    async with trio.open_nursery() as nursery:
        wan = await start_wan(nursery)
        with trio.fail_after(10):
            async with await connect(wan) as s:
                await s.send_all(b"before")
                assert await receive_exactly(s, 6) == b"before"
                wan.stall()
                up_before = wan.statistics()["bytes_up"]
                await s.send_all(b"during the stall")
                with trio.move_on_after(0.3) as quiet:
                    await s.receive_some(100)
                assert quiet.cancelled_caught
                assert wan.statistics()["bytes_up"] == up_before  # nothing forwarded
                assert wan.statistics()["open_connections"] == 1  # still open
                wan.restore()
                assert await receive_exactly(s, 16) == b"during the stall"
        nursery.cancel_scope.cancel()


async def test_rate_cap_schedule_and_backpressure() -> None:
    rate, buffer_bytes = 200_000, 32 * 1024
    payload = os.urandom(150_000)
    async with trio.open_nursery() as nursery:
        wan = await start_wan(nursery, rate_bps=rate, buffer_bytes=buffer_bytes)
        with trio.fail_after(20):
            async with await connect(wan) as s, trio.open_nursery() as inner:
                inner.start_soon(s.send_all, payload)
                assert await receive_exactly(s, len(payload)) == payload
        for d in Direction:
            burst = wan.bucket(d).burst
            pieces = [p for p in wan.records if p.direction is d]
            assert all(p.size <= burst for p in pieces)
            # in every window, bytes permitted <= burst + rate * window
            for i in range(len(pieces)):
                total = 0
                for j in range(i, len(pieces)):
                    total += pieces[j].size
                    window = pieces[j].permit - pieces[i].permit
                    assert total <= burst + rate * window + 1e-6 * rate
            span = pieces[-1].permit - pieces[0].permit
            assert span >= (len(payload) - burst) / rate - 1e-6
        assert 0 < wan.statistics()["max_buffered"] <= buffer_bytes
        nursery.cancel_scope.cancel()


async def test_sender_is_held_back_when_the_buffer_is_full() -> None:
    async with trio.open_nursery() as nursery:
        wan = await start_wan(nursery, rate_bps=20_000, buffer_bytes=16 * 1024)
        with trio.fail_after(10):
            async with await connect(wan) as s:
                with trio.move_on_after(1.0) as blocked:
                    await s.send_all(b"x" * 32_000_000)  # far more than the kernel buffers
                assert blocked.cancelled_caught  # TCP backpressure reached the sender
                assert wan.statistics()["max_buffered"] <= 16 * 1024
        nursery.cancel_scope.cancel()


async def test_control_port_commands() -> None:
    async with trio.open_nursery() as nursery:
        wan = await start_wan(nursery, control=("127.0.0.1", 0))
        assert wan.control_address is not None
        with trio.fail_after(10):
            reply = await send_control(wan.control_address, "set delay_ms=25 jitter_ms=5 dir=up")
            assert reply.startswith("ok ")
            settings = json.loads(reply[3:])["settings"]
            assert settings["up"]["delay_ms"] == 25.0 and settings["up"]["jitter_ms"] == 5.0
            assert settings["down"]["delay_ms"] == 0.0
            await send_control(wan.control_address, "set rate_bps=1000000")
            assert wan.bucket(Direction.DOWN).rate == 1_000_000
            assert (
                json.loads((await send_control(wan.control_address, "stall"))[3:])["state"]
                == "stalled"
            )
            assert "cut" in await send_control(wan.control_address, "cut")
            assert wan.state.value == "cut"
            s = await connect(wan)
            await assert_closed(s)
            await s.aclose()
            await send_control(wan.control_address, "restore")
            stats = json.loads((await send_control(wan.control_address, "stats"))[3:])
            assert stats["state"] == "flowing" and stats["refused"] == 1
        nursery.cancel_scope.cancel()


async def test_control_errors_name_the_fix() -> None:
    async with trio.open_nursery() as nursery:
        wan = await start_wan(nursery)
        assert apply_command(wan, "bogus").startswith("error unknown command")
        assert "delay_ms=" in apply_command(wan, "set speed=3")
        assert apply_command(wan, "set delay_ms=-1").startswith("error")
        assert apply_command(wan, "cut sideways").startswith("error usage")
        assert wan.paths[Direction.UP].delay_ms == 0.0  # nothing half-applied
        nursery.cancel_scope.cancel()


async def test_unreachable_target_resets_the_client() -> None:
    async with trio.open_nursery() as nursery:
        sock = trio.socket.socket()
        await sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[:2]
        sock.close()  # nothing listens there now
        wan: WanEmulator = await nursery.start(functools.partial(serve_wan, ("127.0.0.1", 0), dead))
        s = await connect(wan)
        await assert_closed(s)
        await s.aclose()
        assert wan.statistics()["target_failures"] == 1
        nursery.cancel_scope.cancel()


async def test_lifting_the_rate_cap_frees_a_waiting_writer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # "set rate_bps=0" while a connection waited for tokens used to divide by zero.
    from lab.wan import TokenBucket

    bucket = TokenBucket(100)
    async with trio.open_nursery() as nursery:
        # A piece larger than the burst (a whole read of the connection) waits.
        nursery.start_soon(bucket.take, bucket.burst + 1000)
        await trio.sleep(1)
        bucket.set_rate(0)
    with trio.fail_after(10):
        await bucket.take(10**6)  # no cap: at once
