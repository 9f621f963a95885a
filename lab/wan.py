"""A userspace WAN emulator: a trio TCP proxy with delay, jitter, a rate cap, cut and stall.

Theory of operation
-------------------
The kernel on the lab machines has no ``netem``, so the lab puts this proxy
between the egress and the ingress.  Every accepted connection is paired with
a connection to the target, and each direction (``up``: client to target,
``down``: target to client) is a pipe of two tasks:

* the reader takes a chunk from the sender, stamps its arrival time, gives it
  a release time ``arrival + delay ± jitter`` raised to the previous chunk's
  release time (TCP cannot reorder, so releases are monotonic), and queues
  it.  The queue is bounded in bytes (``buffer_bytes``): when it is full the
  reader stops reading, so the sender's TCP window closes (backpressure,
  never unbounded buffering).
* the writer waits for the release time, for the link to be flowing (not
  stalled), and for tokens from the direction's token bucket (shared by all
  connections, as a real link's bandwidth is), then forwards the bytes.

Every forwarded piece is recorded (arrival, release, permit time, size) in a
bounded ring, so tests assert on the proxy's own schedule instead of on
wall-clock sleeps.

Control: ``cut()`` resets every connection (RST, not FIN) and resets new
ones as soon as they are accepted (or, with ``blackhole=True``, holds them
open and silent); ``stall()`` keeps connections open but forwards nothing;
``restore()`` ends either.  The same commands come as lines on an optional
control port (``cut``, ``cut blackhole``, ``stall``, ``restore``,
``set delay_ms=25 jitter_ms=5 rate_bps=1000000 [dir=up|down]``, ``stats``);
every reply is one line, ``ok {json}`` or ``error <text>``.

Units: ``rate_bps`` is BYTES per second (0 = no cap); delays in milliseconds.

    python -m lab.wan --listen 127.0.0.1:7000 --target 127.0.0.1:7001 \\
        --delay-ms 25 --control 127.0.0.1:7002
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import enum
import functools
import json
import logging
import random
import socket
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import trio

log = logging.getLogger("drgate.wan")

MAX_CHUNK: Final = 64 * 1024  # one read from a sender
# 256 KiB per direction per connection: a few RTTs of a 25 ms link at tens of
# MB/s, and small enough that a stall backs up into the sender's TCP window.
DEFAULT_BUFFER_BYTES: Final = 256 * 1024
# Token bucket burst: 10 ms of the rate, at least one chunk of 16 KiB, so a cap
# is smooth at the scale of the delays we emulate.
MIN_BURST: Final = 16 * 1024
RECORD_LIMIT: Final = 100_000  # forwarded pieces kept for inspection (a ring)

Address = tuple[str, int]


class Direction(enum.Enum):
    UP = "up"  # client -> target
    DOWN = "down"  # target -> client


class LinkState(enum.Enum):
    FLOWING = "flowing"
    STALLED = "stalled"
    CUT = "cut"


@dataclass(slots=True)
class PathSettings:
    """One direction's impairments."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_bps: int = 0  # bytes per second; 0 = no cap

    def validate(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.rate_bps < 0:
            raise ValueError(f"delays and rate must be >= 0: {self}")


@dataclass(frozen=True, slots=True)
class Piece:
    """One forwarded piece of bytes, with its schedule (trio clock seconds)."""

    conn: int
    direction: Direction
    size: int
    arrival: float  # read from the sender
    release: float  # due by delay and jitter
    permit: float  # cleared by the token bucket (>= release), just before the write


class TokenBucket:
    """Bytes per second with a burst; shared by every connection of a direction."""

    def __init__(self, rate: int) -> None:
        self._lock = trio.Lock()  # FIFO: connections take turns
        self.set_rate(rate)

    def set_rate(self, rate: int) -> None:
        self.rate = rate
        self.burst = max(MIN_BURST, rate // 100)
        self._tokens = float(self.burst)
        self._last = trio.current_time()

    async def take(self, n: int) -> float:
        """Wait until ``n`` bytes may go; the time the bucket cleared them (what
        the rate is judged by: the caller may run a little later)."""
        if self.rate <= 0:
            return trio.current_time()
        async with self._lock:
            while True:
                now = trio.current_time()
                if self.rate <= 0:
                    return now  # the cap was lifted while this waited
                self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
                self._last = now
                # A piece larger than the burst goes once the bucket is full,
                # and leaves it in debt: the average rate holds either way.
                if self._tokens >= min(n, self.burst):
                    self._tokens -= n
                    return now
                await trio.sleep((min(n, self.burst) - self._tokens) / self.rate)


@dataclass
class _Pipe:
    """A direction of one connection: the bounded queue between reader and writer."""

    buffered: int = 0
    last_release: float = 0.0
    queue: collections.deque[tuple[float, float, bytes]] = field(default_factory=collections.deque)
    changed: trio.Event = field(default_factory=trio.Event)

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class WanEmulator:
    """The proxy's state and controls.  Run it with :func:`serve_wan`.

    Methods are synchronous and take effect at once (call them from trio
    code, in the emulator's trio run).
    """

    def __init__(
        self,
        target: Address,
        *,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        rate_bps: int = 0,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        seed: int | None = None,
    ) -> None:
        self.target = target
        self.buffer_bytes = buffer_bytes
        self.paths = {d: PathSettings(delay_ms, jitter_ms, rate_bps) for d in Direction}
        for p in self.paths.values():
            p.validate()
        self._buckets = {d: TokenBucket(rate_bps) for d in Direction}
        self._random = random.Random(seed)
        self.state = LinkState.FLOWING
        self.blackhole = False
        self._flowing = trio.Event()
        self._flowing.set()
        self._conns: dict[int, trio.CancelScope] = {}
        self._held: dict[int, trio.CancelScope] = {}  # blackholed while cut
        self._next_conn = 1
        self.records: collections.deque[Piece] = collections.deque(maxlen=RECORD_LIMIT)
        self.address: Address | None = None  # where it listens, once started
        self.control_address: Address | None = None
        self.counters = {
            "connections": 0,
            "refused": 0,
            "reset": 0,
            "bytes_up": 0,
            "bytes_down": 0,
            "target_failures": 0,
            "max_buffered": 0,  # most bytes ever queued in one direction of one connection
        }

    # --- controls -----------------------------------------------------------------

    def cut(self, *, blackhole: bool = False) -> None:
        """Reset every connection now; reset (or, blackhole, hold silent) new ones."""
        self.state = LinkState.CUT
        self.blackhole = blackhole
        self._flowing = trio.Event()
        for scope in self._conns.values():
            scope.cancel()
        self.counters["reset"] += len(self._conns)
        log.info("wan.cut connections=%d blackhole=%s", len(self._conns), blackhole)

    def stall(self) -> None:
        """Keep connections open, forward nothing (until :meth:`restore`)."""
        if self.state is LinkState.CUT:
            raise ValueError("the link is cut; restore it first")
        self.state = LinkState.STALLED
        if self._flowing.is_set():
            self._flowing = trio.Event()
        log.info("wan.stall connections=%d", len(self._conns))

    def restore(self) -> None:
        """Back to flowing: stalled bytes go (their release times have passed)."""
        self.state = LinkState.FLOWING
        self.blackhole = False
        for scope in self._held.values():
            scope.cancel()
        self._flowing.set()
        log.info("wan.restore")

    def set(
        self,
        *,
        delay_ms: float | None = None,
        jitter_ms: float | None = None,
        rate_bps: int | None = None,
        direction: Direction | str | None = None,
    ) -> None:
        """Change impairments, of one direction or both; applies to bytes read from now on."""
        dirs = list(Direction) if direction is None else [Direction(direction)]
        for d in dirs:
            new = PathSettings(**asdict(self.paths[d]))
            if delay_ms is not None:
                new.delay_ms = float(delay_ms)
            if jitter_ms is not None:
                new.jitter_ms = float(jitter_ms)
            if rate_bps is not None:
                new.rate_bps = int(rate_bps)
            new.validate()
            self.paths[d] = new
            if rate_bps is not None:
                self._buckets[d].set_rate(new.rate_bps)
        log.info("wan.set %s", self._settings_json())

    def bucket(self, direction: Direction) -> TokenBucket:
        return self._buckets[direction]

    def _settings_json(self) -> dict[str, Any]:
        return {d.value: asdict(p) for d, p in self.paths.items()}

    def statistics(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "blackhole": self.blackhole,
            "open_connections": len(self._conns),
            **self.counters,
            "settings": self._settings_json(),
        }

    # --- data path --------------------------------------------------------------------

    def _release_time(self, direction: Direction, arrival: float, pipe: _Pipe) -> float:
        p = self.paths[direction]
        delay = p.delay_ms
        if p.jitter_ms:
            delay = max(0.0, delay + self._random.uniform(-p.jitter_ms, p.jitter_ms))
        release = max(arrival + delay / 1000.0, pipe.last_release)
        pipe.last_release = release
        return release

    async def _read_side(self, src: trio.SocketStream, pipe: _Pipe, direction: Direction) -> None:
        while True:
            while pipe.buffered >= self.buffer_bytes:  # backpressure: stop reading
                await pipe.changed.wait()
            data = await src.receive_some(min(MAX_CHUNK, self.buffer_bytes - pipe.buffered))
            arrival = trio.current_time()
            if not data:  # EOF, queued in order behind the bytes
                pipe.queue.append((arrival, self._release_time(direction, arrival, pipe), b""))
                pipe.wake()
                return
            pipe.queue.append((arrival, self._release_time(direction, arrival, pipe), data))
            pipe.buffered += len(data)
            self.counters["max_buffered"] = max(self.counters["max_buffered"], pipe.buffered)
            pipe.wake()

    async def _write_side(
        self, dst: trio.SocketStream, pipe: _Pipe, direction: Direction, conn: int
    ) -> None:
        counter = f"bytes_{direction.value}"
        while True:
            while not pipe.queue:
                await pipe.changed.wait()
            arrival, release, data = pipe.queue[0]
            if not data:
                # Keep EOF behind the bytes queued before it, and behind a stall.
                await trio.sleep_until(release)
                await self._flowing.wait()
                await dst.send_eof()
                return
            await trio.sleep_until(release)
            view = memoryview(data)
            while view:
                await self._flowing.wait()
                bucket = self._buckets[direction]
                piece = view[: bucket.burst] if bucket.rate > 0 else view
                permit = await bucket.take(len(piece))
                if not self._flowing.is_set():
                    continue  # stalled while waiting for tokens: the bytes wait too
                self.records.append(Piece(conn, direction, len(piece), arrival, release, permit))
                await dst.send_all(piece)
                self.counters[counter] += len(piece)
                view = view[len(piece) :]
            pipe.queue.popleft()
            pipe.buffered -= len(data)
            pipe.wake()

    async def _handle(self, client: trio.SocketStream) -> None:
        conn = self._next_conn
        self._next_conn += 1
        self.counters["connections"] += 1
        _set_nodelay(client)
        if self.state is LinkState.CUT:
            self.counters["refused"] += 1
            if self.blackhole:
                with trio.CancelScope() as scope:
                    self._held[conn] = scope
                    try:
                        await trio.sleep_forever()
                    finally:
                        del self._held[conn]
            _reset(client)
            await client.aclose()
            return
        try:
            server = await trio.open_tcp_stream(*self.target)
        except OSError as exc:
            self.counters["target_failures"] += 1
            log.warning("wan.target_unreachable target=%s:%d error=%s", *self.target, exc)
            _reset(client)
            await client.aclose()
            return
        _set_nodelay(server)
        with trio.CancelScope() as scope:
            self._conns[conn] = scope
            try:
                async with client, server:
                    try:
                        async with trio.open_nursery() as nursery:
                            up, down = _Pipe(), _Pipe()
                            nursery.start_soon(
                                self._pump, client, server, up, Direction.UP, conn, scope
                            )
                            nursery.start_soon(
                                self._pump, server, client, down, Direction.DOWN, conn, scope
                            )
                    finally:
                        if scope.cancel_called:  # cut, or one side broke: RST both
                            _reset(client)
                            _reset(server)
            finally:
                del self._conns[conn]

    async def _pump(
        self,
        src: trio.SocketStream,
        dst: trio.SocketStream,
        pipe: _Pipe,
        direction: Direction,
        conn: int,
        conn_scope: trio.CancelScope,
    ) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_side, src, pipe, direction)
                await self._write_side(dst, pipe, direction, conn)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            # One side broke: tear the whole connection down.
            conn_scope.cancel()


def _set_nodelay(stream: trio.SocketStream) -> None:
    with contextlib.suppress(OSError):
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)


def _reset(stream: trio.SocketStream) -> None:
    """Make the coming close send RST instead of FIN."""
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# --- control port ------------------------------------------------------------------------


def apply_command(wan: WanEmulator, line: str) -> str:
    """Run one control line; return the reply line (without newline)."""
    words = line.split()
    if not words:
        return "error empty command"
    cmd, args = words[0].lower(), words[1:]
    try:
        if cmd == "cut":
            if args not in ([], ["blackhole"]):
                return "error usage: cut [blackhole]"
            wan.cut(blackhole=bool(args))
        elif cmd == "stall":
            wan.stall()
        elif cmd == "restore":
            wan.restore()
        elif cmd == "set":
            kwargs: dict[str, Any] = {}
            for arg in args:
                key, sep, value = arg.partition("=")
                if not sep or key not in ("delay_ms", "jitter_ms", "rate_bps", "dir"):
                    return (
                        f"error unknown setting {arg!r}: use delay_ms=, jitter_ms=, rate_bps=, dir="
                    )
                if key == "dir":
                    kwargs["direction"] = value
                elif key == "rate_bps":
                    kwargs[key] = int(value)
                else:
                    kwargs[key] = float(value)
            wan.set(**kwargs)
        elif cmd != "stats":
            return f"error unknown command {cmd!r}: use cut, stall, restore, set, stats"
    except ValueError as exc:
        return f"error {exc}"
    return "ok " + json.dumps(wan.statistics(), sort_keys=True)


async def _serve_control_client(wan: WanEmulator, stream: trio.SocketStream) -> None:
    buf = b""
    async with stream:
        while True:
            try:
                data = await stream.receive_some(4096)
            except trio.BrokenResourceError:
                return
            if not data:
                return
            buf += data
            if len(buf) > 64 * 1024:
                await stream.send_all(b"error line too long\n")
                return
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                reply = apply_command(wan, line.decode("utf-8", "replace"))
                await stream.send_all(reply.encode() + b"\n")


async def serve_wan(
    listen: Address,
    target: Address,
    *,
    control: Address | None = None,
    delay_ms: float = 0.0,
    jitter_ms: float = 0.0,
    rate_bps: int = 0,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    seed: int | None = None,
    task_status: trio.TaskStatus[WanEmulator] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the proxy until cancelled; ``task_status.started(emulator)``.

    Port 0 in ``listen`` or ``control`` picks a free port: read it from
    ``emulator.address`` / ``emulator.control_address``.
    """
    wan = WanEmulator(
        target,
        delay_ms=delay_ms,
        jitter_ms=jitter_ms,
        rate_bps=rate_bps,
        buffer_bytes=buffer_bytes,
        seed=seed,
    )
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, wan._handle, listen[1], host=listen[0])
        )
        wan.address = listeners[0].socket.getsockname()[:2]
        if control is not None:

            async def handler(stream: trio.SocketStream) -> None:
                await _serve_control_client(wan, stream)

            ctl = await nursery.start(
                functools.partial(trio.serve_tcp, handler, control[1], host=control[0])
            )
            wan.control_address = ctl[0].socket.getsockname()[:2]
        log.info(
            "wan.serving listen=%s target=%s control=%s settings=%s",
            wan.address,
            target,
            wan.control_address,
            json.dumps(wan._settings_json()),
        )
        task_status.started(wan)


async def send_control(address: Address, line: str) -> str:
    """Send one control line to a running emulator and return its reply line."""
    async with await trio.open_tcp_stream(*address) as stream:
        await stream.send_all(line.encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            data = await stream.receive_some(65536)
            if not data:
                break
            buf += data
    return buf.split(b"\n", 1)[0].decode()


def _address(text: str) -> Address:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.wan", description="Userspace WAN emulator (TCP proxy)."
    )
    parser.add_argument("--listen", type=_address, help="HOST:PORT to accept on")
    parser.add_argument("--target", type=_address, help="HOST:PORT to forward to")
    parser.add_argument("--control", type=_address, help="HOST:PORT for control lines")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each way")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="± uniform jitter")
    parser.add_argument("--rate-bps", type=int, default=0, help="cap, BYTES/s each way (0: none)")
    parser.add_argument("--buffer-bytes", type=int, default=DEFAULT_BUFFER_BYTES)
    parser.add_argument(
        "--send", metavar="LINE", help="send LINE to --control of a running emulator and exit"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.send is not None:
        if args.control is None:
            parser.error("--send needs --control")
        try:
            reply = trio.run(send_control, args.control, args.send)
        except OSError as exc:
            print(
                f"error: no WAN emulator control port at {args.control[0]}:{args.control[1]}: {exc}"
            )
            return 1
        print(reply)
        return 0 if reply.startswith("ok") else 1
    if args.listen is None or args.target is None:
        parser.error("--listen and --target are required (unless --send)")

    async def run() -> None:
        await serve_wan(
            args.listen,
            args.target,
            control=args.control,
            delay_ms=args.delay_ms,
            jitter_ms=args.jitter_ms,
            rate_bps=args.rate_bps,
            buffer_bytes=args.buffer_bytes,
        )

    try:
        trio.run(run)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
