"""LinkSender: the egress end of the WAN link (the TCP client), sans-IO.

Theory of operation
-------------------
One ``LinkSender`` lives for one connection.  The caller:

1. ``start(now, resume_point=...)`` and writes the HELLO bytes;
2. feeds what it reads to ``receive_data`` (``b""`` at EOF) and drains
   ``next_event()`` until ``NEED_DATA``: first a :class:`Welcome` whose
   ``resume_from`` says where to resume, then ``Acked`` (trim the spool),
   ``PongReceived``, ``PeerError``, ``Stalled``, ``ConnectionClosed``;
   a ``PeerError`` with code ``GAP`` means D misses events before one that was
   sent (its ``prev_seq`` is not there): the next connection must resync;
3. queues events with ``send_event`` (seq strictly above ``resume_from`` and
   above every event queued before, ``prev_seq`` the previous forwarded event
   of the stream, else ``LocalProtocolError``), or a resync with
   ``begin_resync`` / ``send_chunk`` / ``end_resync``;
4. writes what ``data_to_send(now)`` returns, and sleeps until the deadline
   ``tick(now)`` returns (or until more input arrives).

After a reconnect the caller builds a fresh ``LinkSender`` and replays its
spool from the new ``Welcome.resume_from``: nothing here survives a connection.

Time is a float in seconds from a monotonic clock (``trio.current_time()``),
passed in by the caller.  Timers that start "when something is queued" start
at the first ``data_to_send(now)`` or ``tick(now)`` that sees it queued, and
the peer counts as heard at the first such call after one of its frames was
parsed (the same rule as Proton's ``Transport.tick``).

Batching: queued events go out in one BATCH when ``batch_max_events`` or
``batch_max_bytes`` is reached, or when the oldest has waited ``linger``.
With no linger (``linger=0``) every ``data_to_send`` sends what is queued:
the caller's own wake-ups do the batching (the egress queues every event
spooled since its last pass, so a busy stream fills batches and a quiet one
sends each event at once).
Window: the raw bytes of events (and resync chunks) sent and not yet acked
never exceed the window granted in WELCOME (one batch may exceed it when
nothing at all is in flight, so one big event cannot deadlock the link);
when the window is full ``window_full`` is True and nothing more is sent.
Compression: with the zstd codec granted, each batch is compressed at level 1
and sent uncompressed when that does not save at least 1/16 of it.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Final

import zstandard

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.link.events import (
    NEED_DATA,
    Acked,
    ConnectionClosed,
    LinkEvent,
    NeedData,
    PeerError,
    PongReceived,
    Stalled,
)
from protocol.link.frames import (
    CODECS_ALL,
    DEFAULT_MAX_FRAME_BYTES,
    EVENT_OVERHEAD,
    HEADER_SIZE,
    HEARTBEAT_MINOR,
    U64_MAX,
    Ack,
    Codec,
    ErrorFrame,
    Frame,
    Hello,
    LinkErrorCode,
    Ping,
    Pong,
    ResyncBegin,
    ResyncChunk,
    ResyncEnd,
    Welcome,
    batch_frame_bytes,
    check_minor_untrusted,
    encode_frame,
    is_streamed,
    pack_events,
    remote_error,
)
from protocol.link.machine import Failure, TransitionTable
from protocol.link.splitter import FrameSplitter

# 8 MiB of unacked events: at 50 ms RTT that still allows ~160 MB/s, and it
# bounds what the receiver may have to hold (it enforces the same window).
DEFAULT_WINDOW_BYTES: Final = 8 * 1024 * 1024
# 256 KiB batches: large enough for zstd to find repetition across messages,
# small enough to keep per-batch latency low on a slow WAN.
DEFAULT_BATCH_MAX_BYTES: Final = 256 * 1024
DEFAULT_BATCH_MAX_EVENTS: Final = 1000
# No linger: what the egress finds spooled at each pass leaves as one batch, so
# the stream batches itself (one event at low load, full batches at
# saturation); about 3 ms less lag at every load than a 5 ms linger, at no cost
# in CPU or throughput (docs/performance.md, sixth round).
DEFAULT_LINGER: Final = 0.0
# A ping every 5 s and a peer silent for 15 s is dead: three pings lost.
DEFAULT_PING_INTERVAL: Final = 5.0
DEFAULT_HEARTBEAT_TIMEOUT: Final = 15.0
# Batch/resync header bytes inside the frame payload (see frames.BATCH).
_BATCH_OVERHEAD: Final = HEADER_SIZE + 29
# Keep at most this many unanswered pings (older ones no longer give an RTT).
_MAX_PINGS_IN_FLIGHT: Final = 8


class SenderState(enum.Enum):
    IDLE = "IDLE"  # created, start() not called
    HELLO_SENT = "HELLO_SENT"  # waiting for WELCOME
    STREAMING = "STREAMING"
    RESYNCING = "RESYNCING"  # between begin_resync() and end_resync()
    CLOSED = "CLOSED"  # peer closed, sent ERROR, or stalled
    ERROR = "ERROR"  # the peer violated the protocol


class SenderInput(enum.Enum):
    START = "START"
    SEND_EVENT = "SEND_EVENT"
    BEGIN_RESYNC = "BEGIN_RESYNC"
    SEND_CHUNK = "SEND_CHUNK"
    END_RESYNC = "END_RESYNC"
    SEND_ERROR = "SEND_ERROR"
    # frames and happenings from the peer
    WELCOME = "WELCOME"
    ACK = "ACK"
    PONG = "PONG"
    ERROR_FRAME = "ERROR_FRAME"
    EOF = "EOF"
    TIMEOUT = "TIMEOUT"


_S = SenderState
_I = SenderInput
_LIVE = (_S.HELLO_SENT, _S.STREAMING, _S.RESYNCING)
SENDER_TABLE: Final = TransitionTable[SenderState, SenderInput](
    {
        (_S.IDLE, _I.START): _S.HELLO_SENT,
        (_S.HELLO_SENT, _I.WELCOME): _S.STREAMING,
        (_S.STREAMING, _I.SEND_EVENT): _S.STREAMING,
        (_S.STREAMING, _I.BEGIN_RESYNC): _S.RESYNCING,
        (_S.STREAMING, _I.ACK): _S.STREAMING,
        (_S.STREAMING, _I.PONG): _S.STREAMING,
        (_S.RESYNCING, _I.SEND_EVENT): _S.RESYNCING,
        (_S.RESYNCING, _I.SEND_CHUNK): _S.RESYNCING,
        (_S.RESYNCING, _I.END_RESYNC): _S.STREAMING,
        (_S.RESYNCING, _I.ACK): _S.RESYNCING,
        (_S.RESYNCING, _I.PONG): _S.RESYNCING,
        **{(s, _I.ERROR_FRAME): _S.CLOSED for s in _LIVE},
        **{(s, _I.EOF): _S.CLOSED for s in (*_LIVE, _S.CLOSED)},
        **{(s, _I.TIMEOUT): _S.CLOSED for s in _LIVE},
        **{(s, _I.SEND_ERROR): _S.CLOSED for s in (_S.IDLE, *_LIVE, _S.CLOSED, _S.ERROR)},
    },
    remote_inputs=frozenset({_I.WELCOME, _I.ACK, _I.PONG, _I.ERROR_FRAME}),
)


@dataclass(frozen=True, slots=True)
class SenderConfig:
    """Static settings of the egress end.  Times in seconds, sizes in bytes."""

    origin_cluster: str
    target_cluster: str
    incarnation: int
    epoch: int
    window_bytes: int = DEFAULT_WINDOW_BYTES
    batch_max_bytes: int = DEFAULT_BATCH_MAX_BYTES
    batch_max_events: int = DEFAULT_BATCH_MAX_EVENTS
    linger: float = DEFAULT_LINGER
    ping_interval: float = DEFAULT_PING_INTERVAL
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    codecs: int = CODECS_ALL
    """Codecs offered in HELLO; ``1 << Codec.NONE`` alone disables compression."""
    zstd_level: int = 1


@dataclass(frozen=True, slots=True)
class SenderStatistics:
    state: str
    events: int  # events sent in batches
    batches: int
    compressed_batches: int
    bytes_raw: int  # event bytes before compression (seq/time/length headers included)
    bytes_sent: int  # bytes of every frame handed to the caller
    bytes_received: int
    acked_seq: int
    last_sent_seq: int
    unacked_events: int
    unacked_bytes: int
    queued_events: int  # accepted by send_event, not yet in a batch
    window_bytes: int
    window_full: bool
    pings: int
    rtt: float | None  # last RTT in seconds
    srtt: float | None  # smoothed RTT (1/8 EWMA, as TCP)
    resync_chunks_sent: int


class LinkSender:
    """Sans-IO egress end of the link.  See the module docstring for the contract."""

    def __init__(self, config: SenderConfig) -> None:
        self.config = config
        self.state = SenderState.IDLE
        self._failure = Failure()
        self._splitter = FrameSplitter(config.max_frame_bytes)
        self._events: deque[Acked | PongReceived | PeerError | Stalled | ConnectionClosed | Welcome]
        self._events = deque()
        self._out: list[bytes] = []
        # queued items in wire order: events and resync frames
        self._queue: deque[LinkEvent | ResyncBegin | ResyncChunk | ResyncEnd] = deque()
        self._queued_bytes = 0  # raw bytes of LinkEvents in _queue
        # events queued during a resync: they go after RESYNC_END
        self._held: list[LinkEvent] = []
        self._queued_events = 0
        self._linger_start: float | None = None
        # in flight: (seq, raw bytes) per event; chunk sizes in send order
        self._inflight: deque[tuple[int, int]] = deque()
        self._inflight_chunks: deque[int] = deque()
        self._unacked_bytes = 0
        self._chunks_acked = 0
        self._chunks_sent = 0
        self._window = config.window_bytes
        self._codec = Codec.NONE
        self._compressor = zstandard.ZstdCompressor(level=config.zstd_level)
        self.resume_from = 0
        self._last_queued_seq = 0  # seq floor for send_event (incl. resync cuts)
        self._last_sent_seq = 0  # highest seq the receiver may ack
        self._acked_seq = 0
        self._resync: ResyncBegin | None = None
        self._resync_chunks = 0
        self._resync_bytes = 0
        # time keeping
        self._heard = False  # a frame was parsed since the last clock reading
        self._last_heard = 0.0
        self._next_ping: float | None = None
        self._pings: dict[int, float] = {}
        self._pong_pending: list[float] = []  # send times of pings answered, RTT not yet read
        self._peer_minor = 0  # the WELCOME's
        self._position: tuple[int, int] | None = None  # (time_us, last_seq) for heartbeats
        self._stalled_reported = False
        # statistics
        self._n_events = 0
        self._n_batches = 0
        self._n_compressed = 0
        self._bytes_raw = 0
        self._bytes_sent = 0
        self._bytes_received = 0
        self._n_pings = 0
        self._rtt: float | None = None
        self._srtt: float | None = None
        self._window_full = False

    # -- caller inputs ---------------------------------------------------------

    def _apply(self, what: SenderInput) -> None:
        self._failure.check("sender")
        self.state = SENDER_TABLE.next_state(self.state, what, "sender")

    def start(self, now: float, *, resume_point: int = 0) -> bytes:
        """The HELLO bytes.  ``resume_point``: the spool can replay every event
        with a seq above it (0: from the beginning of the stream)."""
        if not 0 <= resume_point <= U64_MAX:
            raise LocalProtocolError(f"resume_point {resume_point} out of range")
        self._apply(SenderInput.START)
        cfg = self.config
        hello = Hello(
            origin_cluster=cfg.origin_cluster,
            target_cluster=cfg.target_cluster,
            incarnation=cfg.incarnation,
            epoch=cfg.epoch,
            resume_point=resume_point,
            window_bytes=cfg.window_bytes,
            codecs=cfg.codecs,
        )
        self._last_heard = now
        data = encode_frame(hello)
        self._bytes_sent += len(data)
        return data

    def send_event(self, event: LinkEvent) -> None:
        """Queue one event for batching.  Its seq must be above ``resume_from``
        and above every seq queued before, and its ``prev_seq`` below its seq
        (LocalProtocolError otherwise).  ``prev_seq`` is passed on as given:
        the receiver checks it (``GAP``)."""
        if event.seq <= self._last_queued_seq:
            floor = (
                "resume point" if self._last_queued_seq == self.resume_from else "last queued seq"
            )
            raise LocalProtocolError(
                f"event seq {event.seq} is not above the {floor} {self._last_queued_seq}",
                code=int(LinkErrorCode.OUT_OF_ORDER),
            )
        if event.seq > U64_MAX or not 0 <= event.time_us <= U64_MAX:
            raise LocalProtocolError(f"event seq {event.seq} or time {event.time_us} out of range")
        if not 0 <= event.prev_seq < event.seq:
            raise LocalProtocolError(
                f"event seq {event.seq} names {event.prev_seq} as its previous forwarded event: "
                "prev_seq must lie below seq"
            )
        size = EVENT_OVERHEAD + len(event.payload)
        if size + _BATCH_OVERHEAD > self.config.max_frame_bytes:
            raise LocalProtocolError(
                f"event seq {event.seq} of {len(event.payload)} bytes cannot fit a frame "
                f"of at most {self.config.max_frame_bytes} bytes"
            )
        self._apply(SenderInput.SEND_EVENT)
        self._last_queued_seq = event.seq
        if self.state is SenderState.RESYNCING:
            self._held.append(event)
            return
        self._queue.append(event)
        self._queued_bytes += size
        self._queued_events += 1

    def begin_resync(
        self, cut_seq: int, *, total_chunks: int = 0, total_bytes: int = 0, scope: str = ""
    ) -> None:
        """Queue RESYNC_BEGIN: a snapshot cut at ``cut_seq`` follows in
        ``total_chunks`` chunks of ``total_bytes`` in all, or, with both 0, in
        chunks made as they are sent (a streamed resync: RESYNC_END carries
        the totals).  Events queued after it need seq > cut_seq."""
        if cut_seq < self._last_queued_seq:
            raise LocalProtocolError(
                f"resync cut {cut_seq} is below seq {self._last_queued_seq} already queued"
            )
        self._apply(SenderInput.BEGIN_RESYNC)
        begin = ResyncBegin(
            epoch=self.config.epoch,
            cut_seq=cut_seq,
            total_chunks=total_chunks,
            total_bytes=total_bytes,
            scope=scope,
        )
        encode_frame(begin)  # fail now (LocalProtocolError) if a field does not fit
        self._resync = begin
        self._resync_chunks = 0
        self._resync_bytes = 0
        self._last_queued_seq = cut_seq
        self._queue.append(begin)

    def send_chunk(self, data: bytes) -> None:
        """Queue the next resync chunk (its index is given by the order of calls)."""
        self._apply(SenderInput.SEND_CHUNK)
        assert self._resync is not None
        if not is_streamed(self._resync) and self._resync_chunks >= self._resync.total_chunks:
            raise LocalProtocolError(f"resync announced {self._resync.total_chunks} chunks only")
        if len(data) + HEADER_SIZE + 9 > self.config.max_frame_bytes:
            raise LocalProtocolError(f"resync chunk of {len(data)} bytes cannot fit a frame")
        codec = self._codec
        self._queue.append(ResyncChunk(index=self._resync_chunks, data=data, codec=codec))
        self._resync_chunks += 1
        self._resync_bytes += len(data)

    def end_resync(self) -> None:
        """Queue RESYNC_END; every announced chunk must have been queued."""
        begin = self._resync
        if (
            begin is not None
            and not is_streamed(begin)
            and (self._resync_chunks, self._resync_bytes) != (begin.total_chunks, begin.total_bytes)
        ):
            raise LocalProtocolError(
                f"resync announced {begin.total_chunks} chunks of {begin.total_bytes} bytes, "
                f"{self._resync_chunks} chunks of {self._resync_bytes} bytes were queued"
            )
        self._apply(SenderInput.END_RESYNC)
        assert begin is not None
        self._queue.append(ResyncEnd(begin.cut_seq, self._resync_chunks, self._resync_bytes))
        self._resync = None
        for event in self._held:
            self._queue.append(event)
            self._queued_bytes += EVENT_OVERHEAD + len(event.payload)
            self._queued_events += 1
        self._held.clear()

    def send_error(self, code: int, text: str, *, retriable: bool) -> bytes:
        """An ERROR frame to write before closing; the sender is CLOSED after it."""
        self.state = SENDER_TABLE.next_state(self.state, SenderInput.SEND_ERROR, "sender")
        return encode_frame(ErrorFrame(code=code, text=text, retriable=retriable))

    # -- bytes from the peer ---------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes read from the connection; ``b""`` means the peer closed it."""
        self._failure.check("sender")
        if self.state is SenderState.ERROR:
            return
        if not data:
            discarded = self._splitter.buffered
            self._apply(SenderInput.EOF)
            self._events.append(ConnectionClosed(clean=discarded == 0, discarded_bytes=discarded))
            return
        self._bytes_received += len(data)
        self._splitter.feed(data)

    def next_event(
        self,
    ) -> Welcome | Acked | PongReceived | PeerError | Stalled | ConnectionClosed | NeedData:
        """The next thing that happened, or ``NEED_DATA``.  Raises
        RemoteProtocolError when the peer broke the protocol."""
        self._failure.check("sender")
        while not self._events:
            if self.state is SenderState.CLOSED:
                return NEED_DATA
            try:
                frame = self._splitter.next_frame_untrusted()
                if frame is None:
                    return NEED_DATA
                self._heard = True
                self._handle(frame)
            except RemoteProtocolError as exc:
                self._failure.error = exc
                self.state = SenderState.ERROR
                raise
        return self._events.popleft()

    def _handle(self, frame: Frame) -> None:
        match frame:
            case Welcome():
                self._apply(SenderInput.WELCOME)
                self._on_welcome(frame)
            case Ack():
                self._apply(SenderInput.ACK)
                self._on_ack(frame)
            case Pong():
                self._apply(SenderInput.PONG)
                sent = self._pings.pop(frame.timestamp_us, None)
                if sent is None:
                    raise remote_error(
                        LinkErrorCode.UNEXPECTED_FRAME,
                        f"PONG for timestamp {frame.timestamp_us} that was never pinged",
                    )
                self._pong_pending.append(sent)
            case ErrorFrame():
                self._apply(SenderInput.ERROR_FRAME)
                self._events.append(PeerError(frame.code, frame.text, frame.retriable))
            case _:
                raise remote_error(
                    LinkErrorCode.UNEXPECTED_FRAME,
                    f"link sender: peer sent a {type(frame).__name__} frame, "
                    "which only a sender may send",
                )

    def _on_welcome(self, w: Welcome) -> None:
        check_minor_untrusted(w.minor, "receiver (D's ingress)")
        cfg = self.config
        if w.incarnation != cfg.incarnation or w.origin_cluster != cfg.origin_cluster:
            raise remote_error(
                LinkErrorCode.WRONG_CLUSTER,
                f"WELCOME for {w.origin_cluster!r} incarnation {w.incarnation:#x}, "
                f"this is {cfg.origin_cluster!r} incarnation {cfg.incarnation:#x}",
            )
        if w.target_cluster != cfg.target_cluster:
            raise remote_error(
                LinkErrorCode.WRONG_CLUSTER,
                f"connected to cluster {w.target_cluster!r}, expected {cfg.target_cluster!r}",
            )
        if w.epoch != cfg.epoch:
            raise remote_error(
                LinkErrorCode.WRONG_EPOCH,
                f"WELCOME for epoch {w.epoch}, this sender is at {cfg.epoch}",
            )
        if not cfg.codecs & (1 << w.codec):
            raise remote_error(
                LinkErrorCode.MALFORMED, f"WELCOME chose codec {w.codec.name}, not offered"
            )
        if w.window_bytes == 0:
            raise remote_error(LinkErrorCode.MALFORMED, "WELCOME grants a window of 0 bytes")
        self._window = min(w.window_bytes, cfg.window_bytes)
        self._codec = w.codec
        self._peer_minor = w.minor
        self.resume_from = w.resume_from
        self._last_queued_seq = self._last_sent_seq = self._acked_seq = w.resume_from
        self._events.append(w)

    def _on_ack(self, ack: Ack) -> None:
        if ack.seq < self._acked_seq or ack.resync_chunks < self._chunks_acked:
            raise remote_error(
                LinkErrorCode.OUT_OF_ORDER,
                f"ACK {ack.seq}/{ack.resync_chunks} went back "
                f"from {self._acked_seq}/{self._chunks_acked}",
            )
        if ack.seq > self._last_sent_seq or ack.resync_chunks > self._chunks_sent:
            raise remote_error(
                LinkErrorCode.OUT_OF_ORDER,
                f"ACK {ack.seq}/{ack.resync_chunks} is beyond what was sent "
                f"(seq {self._last_sent_seq}, {self._chunks_sent} chunks)",
            )
        if ack.seq == self._acked_seq and ack.resync_chunks == self._chunks_acked:
            return
        inflight = self._inflight
        while inflight and inflight[0][0] <= ack.seq:
            self._unacked_bytes -= inflight.popleft()[1]
        for _ in range(ack.resync_chunks - self._chunks_acked):
            self._unacked_bytes -= self._inflight_chunks.popleft()
        self._acked_seq = ack.seq
        self._chunks_acked = ack.resync_chunks
        self._events.append(Acked(ack.seq, ack.resync_chunks))

    # -- bytes to the peer and timers ------------------------------------------

    def _observe(self, now: float) -> None:
        if self._heard:
            self._heard = False
            self._last_heard = now
        for sent in self._pong_pending:
            rtt = max(0.0, now - sent)
            self._rtt = rtt
            self._srtt = rtt if self._srtt is None else self._srtt + (rtt - self._srtt) / 8
            self._events.append(PongReceived(rtt))
        self._pong_pending.clear()
        if self._queued_events and self._linger_start is None:
            self._linger_start = now
        if (
            self.state in _LIVE
            and not self._stalled_reported
            and now - self._last_heard >= self.config.heartbeat_timeout
        ):
            self._stalled_reported = True
            self._apply(SenderInput.TIMEOUT)
            self._events.append(Stalled(now - self._last_heard))

    def data_to_send(self, now: float) -> bytes:
        """Every frame due at ``now``: batches (by size, linger and window),
        resync frames, pings.  ``b""`` when nothing is due."""
        self._failure.check("sender")
        self._observe(now)
        if self.state not in (SenderState.STREAMING, SenderState.RESYNCING):
            return b""
        out = self._out
        self._emit_queue(now)
        if self._next_ping is None:
            self._next_ping = now + self.config.ping_interval
        elif now >= self._next_ping:
            self._next_ping = now + self.config.ping_interval
            ts = round(now * 1_000_000)
            if 0 <= ts <= U64_MAX and ts not in self._pings:
                if len(self._pings) >= _MAX_PINGS_IN_FLIGHT:
                    del self._pings[next(iter(self._pings))]
                self._pings[ts] = now
                self._n_pings += 1
                out.append(encode_frame(self._ping(ts)))
        data = b"".join(out)
        out.clear()
        self._bytes_sent += len(data)
        return data

    def announce(self, *, time_us: int, last_seq: int) -> None:
        """The origin's wall clock (µs since the Unix epoch) and its last
        spooled event's seq now: the next PING carries them to a receiver of
        minor 2 or later (a heartbeat of D's recovery point)."""
        if not (0 <= time_us <= U64_MAX and 0 <= last_seq <= U64_MAX):
            raise LocalProtocolError(f"announce: time {time_us} or seq {last_seq} out of range")
        self._position = (time_us, last_seq)

    def _ping(self, ts: int) -> Ping:
        if self._position is None or self._peer_minor < HEARTBEAT_MINOR:
            return Ping(ts)
        return Ping(ts, *self._position)

    def _room(self, size: int) -> bool:
        return self._unacked_bytes == 0 or self._unacked_bytes + size <= self._window

    def _emit_queue(self, now: float) -> None:
        cfg = self.config
        queue = self._queue
        self._window_full = False
        while queue:
            head = queue[0]
            if isinstance(head, LinkEvent):
                # gather a batch of consecutive events
                batch: list[LinkEvent] = []
                size = 0
                full = False
                for item in queue:
                    if not isinstance(item, LinkEvent):
                        full = True  # a resync frame follows: no reason to linger
                        break
                    esize = EVENT_OVERHEAD + len(item.payload)
                    if batch and (
                        len(batch) >= cfg.batch_max_events
                        or size + esize > cfg.batch_max_bytes
                        or size + esize + _BATCH_OVERHEAD > cfg.max_frame_bytes
                    ):
                        full = True
                        break
                    if not self._room(size + esize):
                        if not batch:
                            self._window_full = True
                            return
                        full = True
                        self._window_full = True
                        break
                    batch.append(item)
                    size += esize
                if not full:
                    start = self._linger_start if self._linger_start is not None else now
                    if len(batch) < cfg.batch_max_events and now < start + cfg.linger:
                        return  # linger: wait for more events
                for _ in batch:
                    queue.popleft()
                self._send_batch(batch, size)
                self._linger_start = now if self._queued_events else None
                if self._window_full:
                    return
            elif isinstance(head, ResyncChunk):
                if not self._room(len(head.data)):
                    self._window_full = True
                    return
                queue.popleft()
                self._inflight_chunks.append(len(head.data))
                self._unacked_bytes += len(head.data)
                self._chunks_sent += 1
                self._out.append(encode_frame(head, compressor=self._compressor))
            else:
                queue.popleft()
                if isinstance(head, ResyncEnd):
                    self._last_sent_seq = max(self._last_sent_seq, head.cut_seq)
                self._out.append(encode_frame(head))

    def _send_batch(self, batch: list[LinkEvent], size: int) -> None:
        raw = pack_events(batch)
        codec = self._codec
        block = raw
        if codec is Codec.ZSTD:
            block = self._compressor.compress(raw)
            if len(block) > len(raw) - len(raw) // 16:
                codec, block = Codec.NONE, raw  # compression does not pay
        self._out.append(batch_frame_bytes(self.config.epoch, batch, codec, raw, block))
        for ev in batch:
            self._inflight.append((ev.seq, EVENT_OVERHEAD + len(ev.payload)))
        self._unacked_bytes += size
        self._queued_bytes -= size
        self._queued_events -= len(batch)
        self._last_sent_seq = batch[-1].seq
        self._n_events += len(batch)
        self._n_batches += 1
        self._bytes_raw += len(raw)
        if codec is not Codec.NONE:
            self._n_compressed += 1

    def tick(self, now: float) -> float | None:
        """Check the heartbeat at ``now`` (a silent peer yields ``Stalled`` from
        ``next_event``) and return when to call ``data_to_send``/``tick`` next,
        or None when only input can change anything."""
        self._failure.check("sender")
        self._observe(now)
        if self.state not in _LIVE:
            return None
        deadlines = [self._last_heard + self.config.heartbeat_timeout]
        if self.state is not SenderState.HELLO_SENT:
            if self._next_ping is not None:
                deadlines.append(self._next_ping)
            else:
                deadlines.append(now)
            if self._queued_events and not self._window_full and self._linger_start is not None:
                deadlines.append(self._linger_start + self.config.linger)
        return min(deadlines)

    @property
    def queued(self) -> int:
        """Items (events, resync frames) queued and not yet sent."""
        return len(self._queue)

    @property
    def window_full(self) -> bool:
        """True when queued items wait for acks to free the window."""
        return self._window_full

    def statistics(self) -> SenderStatistics:
        return SenderStatistics(
            state=self.state.value,
            events=self._n_events,
            batches=self._n_batches,
            compressed_batches=self._n_compressed,
            bytes_raw=self._bytes_raw,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            acked_seq=self._acked_seq,
            last_sent_seq=self._last_sent_seq,
            unacked_events=len(self._inflight),
            unacked_bytes=self._unacked_bytes,
            queued_events=self._queued_events + len(self._held),
            window_bytes=self._window,
            window_full=self._window_full,
            pings=self._n_pings,
            rtt=self._rtt,
            srtt=self._srtt,
            resync_chunks_sent=self._chunks_sent,
        )
