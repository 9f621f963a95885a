"""LinkReceiver: the ingress end of the WAN link (the TCP server), sans-IO.

Theory of operation
-------------------
One ``LinkReceiver`` lives for one accepted connection.  The caller feeds what
it reads to ``receive_data`` (``b""`` at EOF) and drains ``next_event()``
until ``NEED_DATA``:

* :class:`Hello` first (a sender of an older minor version than
  ``LINK_MINOR_OLDEST`` is refused with ``UNSUPPORTED_VERSION``).  The caller
  decides (cluster ids, epoch fencing R7, incarnation, whether it is the
  active ingress) and calls either
  ``accept(resume_from, window_bytes, now)`` with the highest seq already
  applied for that origin incarnation, or ``refuse(code, text, retriable=...)``;
  both return the bytes to write.
* ``EventsReceived``: events in order, every seq above every seq handed up
  before on this connection (and above ``resume_from``).  Events at or below
  it are duplicates: dropped and counted, never handed up.  Every event handed
  up is *continuous*: its ``prev_seq`` (the previous forwarded event) is at or
  below what this end holds (the resume point, the last seq handed up, or a
  resync cut), so no forwarded event between them is missing.  An event whose
  ``prev_seq`` lies above is a gap: the events of its batch before it are
  handed up, it and everything after it never are, and once those are taken
  ``next_event`` raises ``RemoteProtocolError`` with code ``GAP`` (retriable:
  the sender must resync), which the caller sends back as for any other
  protocol error.  ``ack`` cannot pass a gap, since it covers only what was
  handed up.
* ``ResyncBegin``, ``ResyncChunk`` (in index order), ``ResyncEnd``.
* ``Heartbeat``: a minor-2 PING's news of the origin (its time and last
  spooled seq), for D's recovery point.
* ``PeerError``, ``Stalled`` (no frame for ``heartbeat_timeout``),
  ``ConnectionClosed``.

Once the site has applied an event (for the ingress: D's bus delivered its
multicast) the caller calls ``ack(seq)``; ``ack_chunk()`` does the same for
the next resync chunk.  ``data_to_send(now)`` sends a cumulative ACK once
``ack_every_events`` events were acked since the last one, or ``ack_delay``
seconds after the first unsent ack, and a PONG for each PING.

The receiver refuses, with a typed ``RemoteProtocolError`` and nothing else:
damaged frames (magic, version, CRC, flags, malformed payloads), an older
minor version, oversize frames (before buffering them), frames out of place in
the state table, batches of another epoch, seqs going backwards inside a
batch, gaps, resync chunks out of order, and a sender overrunning the window
it was granted.  After that error it stays failed: every further call raises
the same error class.

Time is a float in seconds from a monotonic clock, passed in.  The peer counts
as heard at the first ``data_to_send(now)``/``tick(now)`` after one of its
frames was parsed; the ack timer starts at the first such call after an ack.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Final

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.link.events import (
    NEED_DATA,
    ConnectionClosed,
    EventsReceived,
    Heartbeat,
    LinkEvent,
    NeedData,
    PeerError,
    Stalled,
)
from protocol.link.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    EVENT_OVERHEAD,
    HOLDINGS_MINOR,
    U32_MAX,
    U64_MAX,
    Ack,
    Batch,
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
    check_minor_untrusted,
    encode_frame,
    is_streamed,
    remote_error,
)
from protocol.link.machine import Failure, TransitionTable
from protocol.link.splitter import FrameSplitter

# Ack after 256 applied events or 20 ms, whichever first: one ACK per few
# batches keeps the return path quiet, and 20 ms is small next to the linger
# plus WAN RTT, so the sender's window never waits on the ack timer for long.
DEFAULT_ACK_EVERY_EVENTS: Final = 256
DEFAULT_ACK_DELAY: Final = 0.020
# Three missed pings at the sender's default 5 s interval.
DEFAULT_HEARTBEAT_TIMEOUT: Final = 15.0


class ReceiverState(enum.Enum):
    AWAIT_HELLO = "AWAIT_HELLO"
    HELLO_RECEIVED = "HELLO_RECEIVED"  # the caller must accept() or refuse()
    STREAMING = "STREAMING"
    RESYNCING = "RESYNCING"  # between RESYNC_BEGIN and RESYNC_END
    CLOSED = "CLOSED"
    ERROR = "ERROR"


class ReceiverInput(enum.Enum):
    # from the caller
    ACCEPT = "ACCEPT"
    REFUSE = "REFUSE"
    ACK = "ACK"
    ACK_CHUNK = "ACK_CHUNK"
    SEND_ERROR = "SEND_ERROR"
    # frames and happenings from the peer
    HELLO = "HELLO"
    BATCH = "BATCH"
    PING = "PING"
    RESYNC_BEGIN = "RESYNC_BEGIN"
    RESYNC_CHUNK = "RESYNC_CHUNK"
    RESYNC_END = "RESYNC_END"
    ERROR_FRAME = "ERROR_FRAME"
    EOF = "EOF"
    TIMEOUT = "TIMEOUT"


_S = ReceiverState
_I = ReceiverInput
_LIVE = (_S.AWAIT_HELLO, _S.HELLO_RECEIVED, _S.STREAMING, _S.RESYNCING)
_OPEN = (_S.STREAMING, _S.RESYNCING)
RECEIVER_TABLE: Final = TransitionTable[ReceiverState, ReceiverInput](
    {
        (_S.AWAIT_HELLO, _I.HELLO): _S.HELLO_RECEIVED,
        (_S.HELLO_RECEIVED, _I.ACCEPT): _S.STREAMING,
        (_S.HELLO_RECEIVED, _I.REFUSE): _S.CLOSED,
        (_S.STREAMING, _I.BATCH): _S.STREAMING,
        (_S.STREAMING, _I.RESYNC_BEGIN): _S.RESYNCING,
        (_S.RESYNCING, _I.RESYNC_CHUNK): _S.RESYNCING,
        (_S.RESYNCING, _I.RESYNC_END): _S.STREAMING,
        **{(s, _I.PING): s for s in _OPEN},
        # acks for what was handed up stay legal after the connection closed
        **{(s, _I.ACK): s for s in (*_OPEN, _S.CLOSED)},
        **{(s, _I.ACK_CHUNK): s for s in (*_OPEN, _S.CLOSED)},
        **{(s, _I.ERROR_FRAME): _S.CLOSED for s in _LIVE},
        **{(s, _I.EOF): _S.CLOSED for s in (*_LIVE, _S.CLOSED)},
        **{(s, _I.TIMEOUT): _S.CLOSED for s in _LIVE},
        **{(s, _I.SEND_ERROR): _S.CLOSED for s in (*_LIVE, _S.CLOSED, _S.ERROR)},
    },
    remote_inputs=frozenset(
        {
            _I.HELLO,
            _I.BATCH,
            _I.PING,
            _I.RESYNC_BEGIN,
            _I.RESYNC_CHUNK,
            _I.RESYNC_END,
            _I.ERROR_FRAME,
        }
    ),
)

_FRAME_INPUT: Final[dict[type, ReceiverInput]] = {
    Hello: _I.HELLO,
    Batch: _I.BATCH,
    Ping: _I.PING,
    ResyncBegin: _I.RESYNC_BEGIN,
    ResyncChunk: _I.RESYNC_CHUNK,
    ResyncEnd: _I.RESYNC_END,
    ErrorFrame: _I.ERROR_FRAME,
}


@dataclass(frozen=True, slots=True)
class ReceiverConfig:
    """Static settings of the ingress end.  Times in seconds, sizes in bytes."""

    cluster_id: str
    ack_every_events: int = DEFAULT_ACK_EVERY_EVENTS
    ack_delay: float = DEFAULT_ACK_DELAY
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    allow_zstd: bool = True


@dataclass(frozen=True, slots=True)
class ReceiverStatistics:
    state: str
    events: int  # handed up
    duplicates: int  # dropped: seq at or below the last handed-up seq
    gaps: int  # events refused because their prev_seq was not here (GAP; one ends a connection)
    batches: int
    bytes_received: int
    bytes_sent: int
    acks_sent: int
    last_seq: int  # highest seq handed up (or resume point / resync cut)
    acked_seq: int  # highest seq the caller acked
    unacked_events: int
    unacked_bytes: int
    window_bytes: int
    resync_chunks: int  # handed up on this connection
    pings: int


class LinkReceiver:
    """Sans-IO ingress end of the link.  See the module docstring for the contract."""

    def __init__(self, config: ReceiverConfig, *, now: float) -> None:
        self.config = config
        self.state = ReceiverState.AWAIT_HELLO
        self.hello: Hello | None = None
        self._failure = Failure()
        self._splitter = FrameSplitter(config.max_frame_bytes)
        self._events: deque[
            Hello
            | EventsReceived
            | ResyncBegin
            | ResyncChunk
            | ResyncEnd
            | Heartbeat
            | PeerError
            | Stalled
            | ConnectionClosed
        ] = deque()
        self._out: list[bytes] = []
        self._epoch = 0
        self._window = 0
        self._last_seq = 0
        self._acked_seq = 0
        self._ack_sent_seq = 0
        self._unacked: deque[tuple[int, int]] = deque()  # (seq, raw bytes) handed up, not acked
        self._unacked_bytes = 0
        self._unacked_chunks: deque[int] = deque()
        self._chunks_acked = 0
        self._ack_sent_chunks = 0
        self._acked_since_ack = 0
        self._ack_timer: float | None = None
        self._resync: ResyncBegin | None = None
        self._resync_index = 0
        self._resync_bytes = 0
        self._heard = False
        self._last_heard = now
        self._stalled_reported = False
        # a gap found in a batch, raised once the events before it were taken
        self._gap: RemoteProtocolError | None = None
        # statistics
        self._n_events = 0
        self._n_duplicates = 0
        self._n_gaps = 0
        self._n_batches = 0
        self._n_acks = 0
        self._n_pings = 0
        self._n_chunks = 0
        self._bytes_received = 0
        self._bytes_sent = 0

    def _apply(self, what: ReceiverInput) -> None:
        self._failure.check("receiver")
        self.state = RECEIVER_TABLE.next_state(self.state, what, "receiver")

    # -- caller decisions --------------------------------------------------------

    def accept(
        self, resume_from: int, window_bytes: int, now: float, *, holdings: bytes = b""
    ) -> bytes:
        """Accept the HELLO: the WELCOME bytes.  ``resume_from``: every event up
        to this seq is applied here; ``window_bytes``: the most unacked bytes
        this end will hold (the grant is the smaller of it and the HELLO's);
        ``holdings``: what this site holds (a failback by delta), sent only
        to a sender that reads them."""
        if not 0 <= resume_from <= U64_MAX or not 0 < window_bytes <= U32_MAX:
            raise LocalProtocolError(
                f"resume_from {resume_from} or window {window_bytes} out of range"
            )
        self._apply(ReceiverInput.ACCEPT)
        hello = self.hello
        assert hello is not None
        codec = (
            Codec.ZSTD
            if self.config.allow_zstd and hello.codecs & (1 << Codec.ZSTD)
            else Codec.NONE
        )
        self._epoch = hello.epoch
        self._window = min(window_bytes, hello.window_bytes)
        self._last_seq = self._acked_seq = self._ack_sent_seq = resume_from
        self._last_heard = now
        welcome = Welcome(
            origin_cluster=hello.origin_cluster,
            target_cluster=self.config.cluster_id,
            incarnation=hello.incarnation,
            epoch=hello.epoch,
            resume_from=resume_from,
            window_bytes=self._window,
            codec=codec,
            holdings=holdings if hello.minor >= HOLDINGS_MINOR else b"",
        )
        data = encode_frame(welcome)
        self._bytes_sent += len(data)
        return data

    def refuse(self, code: int, text: str, *, retriable: bool) -> bytes:
        """Refuse the HELLO: the ERROR bytes to write before closing."""
        self._apply(ReceiverInput.REFUSE)
        data = encode_frame(ErrorFrame(code=code, text=text, retriable=retriable))
        self._bytes_sent += len(data)
        return data

    def send_error(self, code: int, text: str, *, retriable: bool) -> bytes:
        """An ERROR frame to write before closing, in any state (e.g. after a
        RemoteProtocolError: ``send_error(exc.code, str(exc), retriable=...)``)."""
        self.state = RECEIVER_TABLE.next_state(self.state, ReceiverInput.SEND_ERROR, "receiver")
        return encode_frame(ErrorFrame(code=code, text=text, retriable=retriable))

    def ack(self, seq: int) -> None:
        """Every handed-up event up to ``seq`` is applied.  ``seq`` must not go
        back and must not pass the last seq handed up."""
        if seq < self._acked_seq or seq > self._last_seq:
            raise LocalProtocolError(
                f"ack({seq}) outside [{self._acked_seq}, {self._last_seq}] "
                "(acks go forward and cover only what was handed up)"
            )
        self._apply(ReceiverInput.ACK)
        unacked = self._unacked
        n = 0
        freed = 0
        while unacked and unacked[0][0] <= seq:
            freed += unacked.popleft()[1]
            n += 1
        self._unacked_bytes -= freed
        self._acked_since_ack += n
        self._acked_seq = seq

    def ack_due_changed(self) -> bool:
        """After ``ack``/``ack_chunk``: whether the caller must call
        ``data_to_send``/``tick`` again before the deadline ``tick`` last gave.
        True for the first ack since the last one sent (its timer starts at
        that call) and once ``ack_every_events`` were acked; False while the
        timer runs for fewer, since the ack then goes at that deadline."""
        return self._ack_pending() and (
            self._ack_timer is None or self._acked_since_ack >= self.config.ack_every_events
        )

    def ack_chunk(self) -> None:
        """The oldest handed-up, unacked resync chunk is applied."""
        if not self._unacked_chunks:
            raise LocalProtocolError("ack_chunk(): no resync chunk handed up and unacked")
        self._apply(ReceiverInput.ACK_CHUNK)
        self._unacked_bytes -= self._unacked_chunks.popleft()
        self._chunks_acked += 1
        self._acked_since_ack += 1

    # -- bytes from the peer -------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes read from the connection; ``b""`` means the peer closed it."""
        self._failure.check("receiver")
        if not data:
            discarded = self._splitter.buffered
            self._apply(ReceiverInput.EOF)
            self._events.append(ConnectionClosed(clean=discarded == 0, discarded_bytes=discarded))
            return
        if self.state is ReceiverState.CLOSED:
            return  # after refuse/error: whatever still arrives is dropped
        self._bytes_received += len(data)
        self._splitter.feed(data)

    def next_event(
        self,
    ) -> (
        Hello
        | EventsReceived
        | ResyncBegin
        | ResyncChunk
        | ResyncEnd
        | Heartbeat
        | PeerError
        | Stalled
        | ConnectionClosed
        | NeedData
    ):
        """The next thing that happened, or ``NEED_DATA``.  Raises
        RemoteProtocolError (only) when the peer broke the protocol."""
        self._failure.check("receiver")
        while not self._events:
            try:
                if self._gap is not None:
                    raise self._gap
                if self.state is ReceiverState.CLOSED:
                    return NEED_DATA
                frame = self._splitter.next_frame_untrusted()
                if frame is None:
                    return NEED_DATA
                self._heard = True
                self._handle(frame)
            except RemoteProtocolError as exc:
                self._failure.error = exc
                self.state = ReceiverState.ERROR
                raise
        return self._events.popleft()

    def _handle(self, frame: Frame) -> None:
        what = _FRAME_INPUT.get(type(frame))
        if what is None:
            raise remote_error(
                LinkErrorCode.UNEXPECTED_FRAME,
                f"link receiver: peer sent a {type(frame).__name__} frame, "
                "which only a receiver sends",
            )
        self._apply(what)
        match frame:
            case Batch():
                self._on_batch(frame)
            case Ping():
                self._n_pings += 1
                self._out.append(encode_frame(Pong(frame.timestamp_us)))
                if frame.origin_time_us is not None and frame.origin_last_seq is not None:
                    self._events.append(Heartbeat(frame.origin_time_us, frame.origin_last_seq))
            case Hello():
                check_minor_untrusted(frame.minor, "sender (P's egress)")
                self.hello = frame
                self._events.append(frame)
            case ResyncBegin():
                self._check_epoch(frame.epoch, "RESYNC_BEGIN")
                if frame.cut_seq < self._last_seq:
                    raise remote_error(
                        LinkErrorCode.OUT_OF_ORDER,
                        f"resync cut {frame.cut_seq} below seq {self._last_seq} already handed up",
                    )
                self._resync = frame
                self._resync_index = 0
                self._resync_bytes = 0
                self._events.append(frame)
            case ResyncChunk():
                self._on_chunk(frame)
            case ResyncEnd():
                begin = self._resync
                assert begin is not None
                announced = (
                    (frame.total_chunks, frame.total_bytes)
                    if is_streamed(begin)
                    else (begin.total_chunks, begin.total_bytes)
                )
                if (
                    frame.cut_seq != begin.cut_seq
                    or (frame.total_chunks, frame.total_bytes) != announced
                    or (self._resync_index, self._resync_bytes) != announced
                ):
                    raise remote_error(
                        LinkErrorCode.MALFORMED,
                        f"RESYNC_END {frame} does not match RESYNC_BEGIN {begin} after "
                        f"{self._resync_index} chunks of {self._resync_bytes} bytes",
                    )
                self._resync = None
                self._last_seq = frame.cut_seq
                self._events.append(frame)
            case ErrorFrame():
                self._events.append(PeerError(frame.code, frame.text, frame.retriable))

    def _check_epoch(self, epoch: int, what: str) -> None:
        if epoch != self._epoch:
            raise remote_error(
                LinkErrorCode.WRONG_EPOCH,
                f"{what} of epoch {epoch} on a connection accepted at epoch {self._epoch}",
            )

    def _take_window(self, size: int, what: str) -> None:
        before = self._unacked_bytes
        if before and before + size > self._window:
            raise remote_error(
                LinkErrorCode.WINDOW_EXCEEDED,
                f"{what} of {size} bytes on top of {before} unacked bytes overruns "
                f"the granted window of {self._window} bytes",
            )
        self._unacked_bytes = before + size

    def _on_batch(self, batch: Batch) -> None:
        """Hand up the new, continuous events of ``batch``: duplicates are
        dropped; at the first event whose previous forwarded event is not
        here, the rest is refused (``GAP``, raised by ``next_event`` once the
        events before it were taken)."""
        self._check_epoch(batch.epoch, "BATCH")
        self._n_batches += 1
        last = self._last_seq
        dups = 0
        size = 0
        fresh: list[LinkEvent] = []
        unacked = self._unacked
        for ev in batch.events:
            if ev.seq <= last:
                dups += 1
                continue
            if ev.prev_seq > last:
                self._n_gaps += 1
                self._gap = self._gap_error(last, ev)
                break
            esize = EVENT_OVERHEAD + len(ev.payload)
            size += esize
            unacked.append((ev.seq, esize))
            fresh.append(ev)
            last = ev.seq
        self._n_duplicates += dups
        if not fresh:
            return
        events = batch.events if len(fresh) == len(batch.events) else tuple(fresh)
        self._take_window(size, f"BATCH {events[0].seq}..{events[-1].seq}")
        self._last_seq = last
        self._n_events += len(events)
        self._events.append(EventsReceived(events, dups))

    def _gap_error(self, last: int, ev: LinkEvent) -> RemoteProtocolError:
        origin = "?" if self.hello is None else self.hello.origin_cluster
        return remote_error(
            LinkErrorCode.GAP,
            f"gap in the stream from {origin}: D holds up to seq {last}; event {ev.seq} says "
            f"the previous forwarded event is {ev.prev_seq}, so {ev.prev_seq}..{ev.seq} are "
            f"missing; P must resync",
            retriable=True,
        )

    def _on_chunk(self, chunk: ResyncChunk) -> None:
        begin = self._resync
        assert begin is not None
        if chunk.index != self._resync_index:
            raise remote_error(
                LinkErrorCode.OUT_OF_ORDER,
                f"resync chunk {chunk.index} where chunk {self._resync_index} was expected",
            )
        if not is_streamed(begin) and (
            chunk.index >= begin.total_chunks
            or self._resync_bytes + len(chunk.data) > begin.total_bytes
        ):
            raise remote_error(
                LinkErrorCode.MALFORMED,
                f"resync chunk {chunk.index} goes past the announced {begin.total_chunks} chunks "
                f"of {begin.total_bytes} bytes",
            )
        self._take_window(len(chunk.data), f"resync chunk {chunk.index}")
        self._unacked_chunks.append(len(chunk.data))
        self._resync_index += 1
        self._resync_bytes += len(chunk.data)
        self._n_chunks += 1
        self._events.append(chunk)

    # -- bytes to the peer and timers ------------------------------------------------

    def _ack_pending(self) -> bool:
        return self._acked_seq > self._ack_sent_seq or self._chunks_acked > self._ack_sent_chunks

    def _observe(self, now: float) -> None:
        if self._heard:
            self._heard = False
            self._last_heard = now
        if self._ack_timer is None and self._ack_pending():
            self._ack_timer = now
        if (
            self.state in _LIVE
            and not self._stalled_reported
            and now - self._last_heard >= self.config.heartbeat_timeout
        ):
            self._stalled_reported = True
            self._apply(ReceiverInput.TIMEOUT)
            self._events.append(Stalled(now - self._last_heard))

    def data_to_send(self, now: float) -> bytes:
        """PONGs, and a cumulative ACK when ``ack_every_events`` were acked or the
        ack timer ran out.  ``b""`` when nothing is due."""
        self._failure.check("receiver")
        self._observe(now)
        out = self._out
        if self.state in _OPEN and self._ack_pending():
            timer = self._ack_timer
            if self._acked_since_ack >= self.config.ack_every_events or (
                timer is not None and now >= timer + self.config.ack_delay
            ):
                out.append(encode_frame(Ack(self._acked_seq, self._chunks_acked)))
                self._ack_sent_seq = self._acked_seq
                self._ack_sent_chunks = self._chunks_acked
                self._acked_since_ack = 0
                self._ack_timer = None
                self._n_acks += 1
        if self.state not in _OPEN:
            out.clear()
        data = b"".join(out)
        out.clear()
        self._bytes_sent += len(data)
        return data

    def tick(self, now: float) -> float | None:
        """Check the heartbeat (a silent peer yields ``Stalled``) and return when
        to call ``data_to_send``/``tick`` next, or None when only input matters."""
        self._failure.check("receiver")
        self._observe(now)
        if self.state not in _LIVE:
            return None
        deadlines = [self._last_heard + self.config.heartbeat_timeout]
        if self._ack_timer is not None and self.state in _OPEN:
            deadlines.append(self._ack_timer + self.config.ack_delay)
        if self._out:
            deadlines.append(now)
        return min(deadlines)

    def statistics(self) -> ReceiverStatistics:
        return ReceiverStatistics(
            state=self.state.value,
            events=self._n_events,
            duplicates=self._n_duplicates,
            gaps=self._n_gaps,
            batches=self._n_batches,
            bytes_received=self._bytes_received,
            bytes_sent=self._bytes_sent,
            acks_sent=self._n_acks,
            last_seq=self._last_seq,
            acked_seq=self._acked_seq,
            unacked_events=len(self._unacked),
            unacked_bytes=self._unacked_bytes,
            window_bytes=self._window,
            resync_chunks=self._n_chunks,
            pings=self._n_pings,
        )
