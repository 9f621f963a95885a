"""The broker journal: what a node applied, on disk, so that it survives a restart.

Theory of operation
-------------------
A node appends the commands it applied, in stream order, as bus frames
(:meth:`Journal.append`), and the view changes that removed members
(:meth:`Journal.append_members_left`: ``members_left`` changes the state but
takes no cseq).  The state machine is deterministic, so a checkpoint (the
state snapshot at a cseq) plus every journaled command after it rebuilds the
node's state exactly (:meth:`Journal.recover`).  The node decides what is
journaled (it elides the bodies of non-durable messages before it hands
the commands over, cluster/state/persistence.py); the journal is
content-agnostic, except that a checkpoint's snapshot leaves out the same
bodies (``st.snapshot(state, transient_bodies=False)``).  The format is in
protocol/journal.py and docs/protocol.md section 4.

*The chain.*  A checkpoint ``checkpoint-C.snap`` is always followed by a
segment ``journal-(C+1).log`` (:meth:`Journal.checkpoint` writes both); the
journal after checkpoint C is the chain of segments that starts there, each
one beginning at the cseq the previous one ended at.  Without a checkpoint
the chain starts at ``journal-1.log`` and the state at ``new_state()``.
Segments named at or below C are obsolete, whatever they hold: a node that
took a state from its peers (a rejoin) checkpoints it, and the history it
had journaled before is never replayed onto it.

*Group commit.*  :meth:`Journal.append` only encodes into a buffer;
:meth:`Journal.commit` writes every buffered record with one ``write`` and
then, with ``fsync: batch``, one ``fdatasync``, and returns the durable
watermark.  ``never`` writes and never syncs (a crashed process loses
nothing, a crashed machine may lose the last seconds).  A failed write cuts
the segment back to its last whole record and raises :class:`JournalError`;
the records stay buffered, so the next commit tries again.

*Checkpoints* bound disk use and restart time: the node calls
:meth:`Journal.checkpoint` when :attr:`Journal.needs_checkpoint` says the
journal has grown ``checkpoint_bytes`` since the last one, or has grown at
all over ``checkpoint_interval_s`` (a slow stream of small frames stays
under the bytes for a long time, and a restart replays every frame).  The snapshot is
written to a temporary file, synced, renamed and its directory synced;
then the new segment is started and every older file deleted.  On disk
there is then one checkpoint and the journal after it.

*Damage.*  :meth:`Journal.open` checks every record of the chain (its CRC,
and that the cseqs follow on).  A record cut short at the end of the last
segment is what a crash mid-write leaves: the tail is truncated away and
logged.  Anything else (a bad record with data after it, a torn segment that
is not the last, a gap between segments, a segment that follows no
checkpoint) is not a crash artefact and raises :class:`JournalError`, which
names the file, the byte offset and the fix: move the directory aside and
start the node, which then takes the state from its peers.  A newest
checkpoint that fails its CRC or does not restore makes :meth:`recover` fall
back to the previous one when the segments after it are still there.

Synchronous file I/O on the caller's thread.  :meth:`Journal.commit` may run
in another thread (a node's committer thread) while the applier appends (the
buffer is taken under a lock) or checkpoints (a checkpoint waits for the
commit under way, and the other way round); every other call, and commits
among themselves, one at a time.

*Replay* applies commands with ``sender=None``: effects are not sent to
anybody, and a ``SessionOpen`` is accepted as it was when the node applied
it (only a member's own sessions pass the live check, and the node journals
what it applied).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from cluster import state as st
from cluster.state import Sender, SiteState
from protocol import cluster as pc
from protocol import journal as pj
from protocol.errors import DrgateError, LocalProtocolError, RemoteProtocolError

log = logging.getLogger("cluster.journal")

__all__ = [
    "DEFAULT_CHECKPOINT_BYTES",
    "DEFAULT_CHECKPOINT_INTERVAL_S",
    "DEFAULT_FSYNC",
    "FSYNC_POLICIES",
    "Journal",
    "JournalError",
    "JournalReport",
    "JournalStatistics",
    "RecoveredState",
    "TornTail",
    "inspect_journal",
    "lock_directory",
    "lock_held",
]

# ``batch``: one fdatasync per commit, so a settled durable message survives
# a power loss, and the node amortises it over a whole batch of frames.
DEFAULT_FSYNC: Final = "batch"
FSYNC_POLICIES: Final = ("never", "batch")
# 64 MiB of journal between checkpoints: a restart replays at most this much
# (seconds), and a checkpoint costs a snapshot of the live state, which at
# this size is written rarely enough not to matter.
DEFAULT_CHECKPOINT_BYTES: Final = 64 << 20
# Seconds after which a journal that grew at all checkpoints (0: bytes only).
DEFAULT_CHECKPOINT_INTERVAL_S: Final = 300.0
LOCK_FILE: Final = "journal.lock"
TMP_SUFFIX: Final = ".tmp"
DAMAGED_SUFFIX: Final = ".damaged"


class JournalError(DrgateError):
    """The journal cannot be used: corrupted, or asked something out of order.

    ``path`` and ``offset`` say where, when a file is to blame.
    """

    def __init__(self, message: str, *, path: Path | None = None, offset: int | None = None):
        super().__init__(message)
        self.path = path
        self.offset = offset


# What a damaged journal's error tells the operator to do (docs/broker.md,
# "Durability"): the one command, and what happens next.
RESEED_HINT: Final = (
    "Fix: stop the node, run `drgate journal reseed --config <this broker's config>` (it moves "
    "{directory} aside, kept for analysis) and start the node: it takes the state from its "
    "peers (the whole site down: from the other brokers' journals, `drgate recover --force` "
    "if they wait for this one)."
)


def _corrupt(path: Path, offset: int, what: str) -> JournalError:
    return JournalError(
        f"{path}: byte offset {offset}: {what}. The journal is corrupted, not torn by a crash. "
        + RESEED_HINT.format(directory=path.parent),
        path=path,
        offset=offset,
    )


@dataclass(frozen=True, slots=True)
class RecoveredState:
    """What :meth:`Journal.recover` rebuilt: the state at ``cseq``, from the
    checkpoint at ``checkpoint_cseq`` (0: none) of ``checkpoint_bytes`` and
    ``frames_replayed`` records after it, in ``seconds`` of wall time (of it
    ``rebuild_seconds`` to restore and replay, the rest to clean up) and
    ``cpu_seconds`` of CPU (far less: a core or the disk was waited for)."""

    state: SiteState
    cseq: int
    frames_replayed: int
    checkpoint_cseq: int
    seconds: float
    cpu_seconds: float = 0.0
    checkpoint_bytes: int = 0
    rebuild_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class JournalStatistics:
    """A snapshot of the journal's counters (``gateway/metrics.py`` exports them)."""

    bytes_on_disk: int
    segments: int
    last_checkpoint_cseq: int  # 0: no checkpoint
    last_checkpoint_time: float | None  # wall time (s since the epoch) it was written
    durable_cseq: int  # highest cseq on disk (0: none)
    bytes_since_checkpoint: int
    commits: int
    fsync_seconds_total: float
    fsync_last_seconds: float


@dataclass(frozen=True, slots=True)
class TornTail:
    """A record cut short at the end of the last segment (a crash mid-write):
    an open cuts ``dropped_bytes`` at ``offset`` of ``path``."""

    path: Path
    offset: int
    dropped_bytes: int
    reason: str


@dataclass(frozen=True, slots=True)
class JournalReport:
    """What :func:`inspect_journal` found in a journal directory.

    ``checkpoint_cseq`` (0: none) and ``last_cseq`` (0: empty) are what a
    start would recover; ``damage`` is the error a start would stop with
    (then the cseqs are what the files' names and headers say);
    ``in_use``: a running node holds the directory."""

    directory: Path
    in_use: bool
    checkpoint_cseq: int
    last_cseq: int
    bytes_on_disk: int
    files: int
    torn_tail: TornTail | None
    damage: JournalError | None


@dataclass(frozen=True, slots=True)
class _Left:
    """A member a journaled view change removed, as ``members_left`` reads it."""

    node: int
    pid: int


@dataclass(slots=True)
class _Segment:
    path: Path
    first_cseq: int
    end_cseq: int  # the cseq after its last record
    size: int  # bytes on disk


@dataclass(slots=True)
class _Checkpoint:
    path: Path
    cseq: int
    size: int


@dataclass(slots=True)
class _Files:
    """What :func:`_scan` found: the base checkpoint and the chain after it."""

    checkpoints: list[_Checkpoint]  # newest first, headers good
    base: _Checkpoint | None
    chain: list[_Segment] = field(default_factory=list)


class Journal:
    """A node's journal in one directory.  Open with :meth:`open`; see the
    module docstring for the guarantees."""

    def __init__(
        self,
        directory: Path,
        fsync: str,
        checkpoint_bytes: int,
        lock_fd: int,
        checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Use Journal.open(); this only sets fields.
        self.directory = directory
        self.fsync = fsync
        self.checkpoint_bytes = checkpoint_bytes
        self.checkpoint_interval_s = checkpoint_interval_s
        self._clock = clock
        self._checkpointed_at = clock()  # at open, or the last checkpoint
        self._lock_fd: int | None = lock_fd
        self._files = _Files([], None)
        self._fd: int | None = None  # the active (last) segment, for appending
        self._next = 1  # the cseq after the last record written
        # Appends may run while a worker thread commits: the lock guards the
        # buffer and ``_appended`` (the cseq after the last record appended).
        self._lock = threading.Lock()
        # Held by a commit and by a checkpoint: the one waits for the other.
        self._io = threading.Lock()
        self._buffer: list[bytes] = []
        self._appended = 1
        self._since_checkpoint = 0  # record bytes written since the base checkpoint
        self._commits = 0
        self._fsync_total = 0.0
        self._fsync_last = 0.0
        self._checkpoint_time: float | None = None

    # --- opening ---------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        fsync: str = DEFAULT_FSYNC,
        checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES,
        checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> Journal:
        """Open (creating it if needed) the journal in ``directory``.

        Checks every record after the newest checkpoint, cuts a torn tail off
        the last segment (logged).  Raises :class:`JournalError` for a bad
        fsync policy, a directory another process holds, or corruption.
        """
        if fsync not in FSYNC_POLICIES:
            raise JournalError(
                f"journal fsync policy {fsync!r} is not one of {', '.join(FSYNC_POLICIES)}"
            )
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        journal = cls(
            path, fsync, checkpoint_bytes, lock_directory(path), checkpoint_interval_s, clock
        )
        try:
            journal._load()
        except BaseException:
            journal.close()
            raise
        return journal

    def _load(self) -> None:
        for tmp in self.directory.glob(f"*{TMP_SUFFIX}"):
            log.info("journal.open removed=unfinished-file file=%s", tmp)
            tmp.unlink()
        files = _scan(self.directory)
        self._files = files
        if files.chain:
            last = files.chain[-1]
            self._next = last.end_cseq
            self._since_checkpoint = sum(s.size - pj.SEGMENT_HEADER_SIZE for s in files.chain)
            self._fd = os.open(last.path, os.O_WRONLY | os.O_APPEND)
        elif files.base is not None:
            self._next = files.base.cseq + 1
            self._start_segment(self._next)
        if files.base is not None:
            self._checkpoint_time = files.base.path.stat().st_mtime
        self._appended = self._next

    # --- recovery --------------------------------------------------------------

    def recover(self) -> RecoveredState | None:
        """The node's state as journaled, or ``None`` for an empty journal.

        Restores the newest checkpoint (or the previous one, if the newest is
        damaged and the segments after the previous one are still there) and
        applies every journaled command after it.  Call it once, after
        :meth:`open` and before appending.  Raises :class:`JournalError` when
        no checkpoint can be used or a record does not decode.
        """
        started, cpu_started = time.perf_counter(), time.process_time()
        if self._files.base is None and self._next == 1:
            return None
        state, ckpt, chain, replayed = _rebuild(self.directory, self._files)
        rebuilt = time.perf_counter()
        self._forget_older(ckpt, chain)
        base, size = (0, 0) if ckpt is None else (ckpt.cseq, ckpt.path.stat().st_size)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return RecoveredState(
            state, state.cseq, replayed, base, seconds, cpu, size, rebuilt - started
        )

    def _forget_older(self, used: _Checkpoint | None, chain: list[_Segment]) -> None:
        """After a recovery from ``used``: delete what no recovery needs any more."""
        keep = {s.path for s in chain}
        if used is not None:
            keep.add(used.path)
        for ckpt in self._files.checkpoints:
            if used is None or ckpt.cseq > used.cseq:  # damaged: kept for analysis
                ckpt.path.rename(ckpt.path.with_name(ckpt.path.name + DAMAGED_SUFFIX))
        _delete_except(self.directory, keep, durable=self.fsync != "never")
        self._files = _Files([] if used is None else [used], used, chain)
        self._since_checkpoint = sum(s.size - pj.SEGMENT_HEADER_SIZE for s in chain)

    # --- appending -------------------------------------------------------------

    def append(self, first_cseq: int, commands: Sequence[pc.Command]) -> None:
        """Buffer one record: the frame of ``commands``, the first at cseq
        ``first_cseq``.  Nothing is written until :meth:`commit`.

        Raises :class:`JournalError` unless ``first_cseq`` follows the last
        record (or, in an empty journal, is 1: a node that starts from a
        state it did not build from cseq 1 calls :meth:`checkpoint` first).
        """
        if not commands:
            return
        try:
            frame = pc.encode_frame(commands)
        except LocalProtocolError as exc:
            raise JournalError(f"cannot journal the frame at cseq {first_cseq}: {exc}") from exc
        self.append_frame(first_cseq, frame, len(commands))

    def append_frame(self, first_cseq: int, frame: bytes, count: int) -> None:
        """:meth:`append` for a frame already encoded (``pc.encode_frame``) of
        ``count`` commands: a node journaling a delivered frame unchanged
        saves encoding it again.  The frame is not checked here; recovery
        decodes it."""
        if count < 1:
            raise JournalError(f"a journaled frame holds at least one command, not {count}")
        try:
            record = pj.encode_record(first_cseq, count, frame)
        except LocalProtocolError as exc:
            raise JournalError(f"cannot journal the frame at cseq {first_cseq}: {exc}") from exc
        with self._lock:
            self._check_follows(first_cseq)
            self._buffer.append(record)
            self._appended = first_cseq + count

    def append_members_left(self, members: Sequence[Sender]) -> None:
        """Buffer a view change that removed ``members`` (their sessions are
        closed by ``st.members_left`` at this point of the stream on replay)."""
        if not members:
            return
        payload = pj.encode_members_left((m.node, m.pid) for m in members)
        with self._lock:
            self._buffer.append(pj.encode_record(self._appended, 0, payload))

    def _check_follows(self, first_cseq: int) -> None:
        expected = self._appended
        if first_cseq == expected:
            return
        if expected == 1 and self._files.base is None:
            raise JournalError(
                f"the journal is empty: its first record must be cseq 1, not {first_cseq}. "
                "A node that took its state from its peers calls checkpoint(state) first."
            )
        raise JournalError(
            f"journal append at cseq {first_cseq} does not follow the last record: "
            f"expected cseq {expected}"
        )

    def commit(self) -> int:
        """Write every buffered record, then one ``fdatasync`` (``batch``).

        Returns the highest cseq on disk (0 if none).  Raises
        :class:`JournalError` if the write or the sync fails; the segment is
        cut back to its last whole record and the records stay buffered.
        May run in another thread while the node appends or checkpoints; one
        commit at a time.
        """
        with self._io:
            return self._commit()

    def _commit(self) -> int:
        with self._lock:
            records, upto = self._buffer, self._appended
            self._buffer = []
        if not records:
            return self.durable_cseq
        if self._fd is None:
            self._start_segment(self._next)
        assert self._fd is not None
        data = b"".join(records)
        seg = self._files.chain[-1]
        try:
            _write_all(self._fd, data)
            self._sync(self._fd)
        except OSError as exc:
            self._cut_back(seg)
            with self._lock:
                self._buffer[:0] = records
            raise JournalError(
                f"{seg.path}: cannot write the journal ({exc}); the node cannot settle "
                "durable messages until it can. Fix: free space on the disk or fix it."
            ) from exc
        seg.size += len(data)
        self._since_checkpoint += len(data)
        self._next = seg.end_cseq = upto
        self._commits += 1
        return self.durable_cseq

    def _cut_back(self, seg: _Segment) -> None:
        try:
            assert self._fd is not None
            os.ftruncate(self._fd, seg.size)
        except OSError as exc:  # the next open cuts it as a torn tail
            log.warning("journal.commit cut=failed file=%s error=%s", seg.path, exc)

    def _sync(self, fd: int) -> None:
        if self.fsync == "never":
            return
        started = time.perf_counter()
        os.fdatasync(fd)
        self._fsync_last = time.perf_counter() - started
        self._fsync_total += self._fsync_last

    @property
    def durable_cseq(self) -> int:
        """The highest cseq on disk (0 if none)."""
        base = 0 if self._files.base is None else self._files.base.cseq
        return max(base, self._next - 1)

    # --- checkpoints -----------------------------------------------------------

    @property
    def needs_checkpoint(self) -> bool:
        """Over ``checkpoint_bytes`` since the last one, or any after ``checkpoint_interval_s``."""
        if self._since_checkpoint > self.checkpoint_bytes:
            return True
        due = self._clock() - self._checkpointed_at >= self.checkpoint_interval_s
        return self.checkpoint_interval_s > 0 and self._since_checkpoint > 0 and due

    def checkpoint(self, state: SiteState) -> None:
        """Make ``state`` (at ``state.cseq``) the journal's base.

        Call it between frames, after appending every command applied to
        ``state``.  Buffered records are dropped (the checkpoint covers
        them); records above ``state.cseq`` are discarded, so a node that took
        its state from its peers checkpoints it and journals on from there.
        The snapshot is synced and renamed into place, a new segment started,
        and every older segment and checkpoint deleted.
        """
        snapshot = st.snapshot(state, transient_bodies=False)
        with self._io:
            self._checkpoint(state.cseq, snapshot)

    def _checkpoint(self, cseq: int, snapshot: bytes) -> None:
        durable = self.fsync != "never"
        path = self.directory / pj.checkpoint_name(cseq)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        _write_file(tmp, [pj.encode_checkpoint_header(cseq, snapshot), snapshot], self._sync)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._next - 1 > cseq:
            log.info("journal.checkpoint discarded=cseq %d-%d", cseq + 1, self._next - 1)
        # Segments named above cseq (the history a rejoin replaced) go before
        # the checkpoint is in place: none of them may follow it.
        for seg_path in _segment_paths(self.directory):
            if _cseq_of(seg_path, pj.SEGMENT_PREFIX, pj.SEGMENT_SUFFIX) > cseq:
                seg_path.unlink()
        os.replace(tmp, path)
        _sync_dir(self.directory, durable)
        ckpt = _Checkpoint(path, cseq, pj.CHECKPOINT_HEADER_SIZE + len(snapshot))
        self._files = _Files([ckpt], ckpt, [])
        with self._lock:
            self._buffer.clear()
            self._appended = cseq + 1
        self._next = cseq + 1
        self._since_checkpoint = 0
        self._checkpoint_time = time.time()
        self._checkpointed_at = self._clock()
        self._start_segment(cseq + 1)
        _delete_except(self.directory, {path, self._files.chain[-1].path}, durable=durable)
        log.info("journal.checkpoint cseq=%d bytes=%d", cseq, ckpt.size)

    def _start_segment(self, first_cseq: int) -> None:
        path = self.directory / pj.segment_name(first_cseq)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        _write_file(tmp, [pj.encode_segment_header(first_cseq)], self._sync)
        os.replace(tmp, path)
        _sync_dir(self.directory, self.fsync != "never")
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._files.chain.append(_Segment(path, first_cseq, first_cseq, pj.SEGMENT_HEADER_SIZE))

    # --- the rest --------------------------------------------------------------

    def statistics(self) -> JournalStatistics:
        """Counters, from memory only."""
        files = self._files
        on_disk = sum(s.size for s in files.chain) + sum(c.size for c in files.checkpoints)
        return JournalStatistics(
            bytes_on_disk=on_disk,
            segments=len(files.chain),
            last_checkpoint_cseq=0 if files.base is None else files.base.cseq,
            last_checkpoint_time=self._checkpoint_time,
            durable_cseq=self.durable_cseq,
            bytes_since_checkpoint=self._since_checkpoint,
            commits=self._commits,
            fsync_seconds_total=self._fsync_total,
            fsync_last_seconds=self._fsync_last,
        )

    def close(self) -> None:
        """Close the files and release the directory (after a commit under way
        in another thread); buffered records are dropped."""
        with self._io:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- replay ---------------------------------------------------------------------


def _rebuild(
    directory: Path, files: _Files, *, torn: list[TornTail] | None = None
) -> tuple[SiteState, _Checkpoint | None, list[_Segment], int]:
    """The state the journal holds: (state, the checkpoint used, the chain
    replayed after it, records replayed).  The newest usable checkpoint wins
    (``files.checkpoints``, then the chain from ``journal-1`` if it is there);
    raises the first checkpoint's :class:`JournalError` when none is usable,
    or the damage a replay meets.  ``torn``: see :func:`_chain`."""
    candidates: list[_Checkpoint | None] = list(files.checkpoints)
    if (directory / pj.segment_name(1)).exists():
        candidates.append(None)  # the chain from the site's first command
    first_error: JournalError | None = None
    for ckpt in candidates:
        try:
            state = _restore(ckpt)
            chain = files.chain if ckpt is files.base else _chain(directory, ckpt, torn=torn)
        except JournalError as exc:
            log.warning("journal.recover checkpoint=unusable error=%s", exc)
            first_error = first_error or exc
            continue
        return state, ckpt, chain, _replay(state, chain)
    raise first_error or JournalError(
        f"{directory}: no checkpoint and no {pj.segment_name(1)}: the journal does "
        "not reach back to the site's first command. " + RESEED_HINT.format(directory=directory),
        path=directory,
    )


def _restore(ckpt: _Checkpoint | None) -> SiteState:
    if ckpt is None:
        return st.new_state()
    data = ckpt.path.read_bytes()
    try:
        cseq, snapshot = pj.decode_checkpoint_untrusted(data)
        state = st.restore_untrusted(snapshot)
    except RemoteProtocolError as exc:
        raise _corrupt(ckpt.path, 0, f"checkpoint is damaged ({exc})") from exc
    if cseq != ckpt.cseq or state.cseq != cseq:
        raise _corrupt(ckpt.path, 0, f"checkpoint says cseq {cseq}, its state cseq {state.cseq}")
    return state


def _replay(state: SiteState, chain: list[_Segment]) -> int:
    replayed = 0
    for seg in chain:
        data = seg.path.read_bytes()[: seg.size]
        offset = pj.SEGMENT_HEADER_SIZE
        while offset < len(data):
            try:
                rec = pj.next_record_untrusted(data, offset)
            except RemoteProtocolError as exc:
                raise _corrupt(seg.path, offset, str(exc)) from exc
            if rec.first_cseq != state.cseq + 1:
                raise _corrupt(
                    seg.path,
                    offset,
                    f"record of cseq {rec.first_cseq} follows the state at cseq {state.cseq}",
                )
            _apply_record(state, seg.path, rec)
            replayed += 1
            offset = rec.end
    return replayed


def _apply_record(state: SiteState, path: Path, rec: pj.JournalRecord) -> None:
    """Apply one record to ``state`` (sender ``None``: the replay's effects are
    not sent to anybody, and a ``SessionOpen`` the node journaled was accepted)."""
    try:
        if rec.count == 0:
            left = [_Left(n, p) for n, p in pj.decode_members_left_untrusted(rec.payload)]
            st.members_left(state, left)
            return
        commands = pc.decode_frame_untrusted(rec.payload)
    except RemoteProtocolError as exc:
        raise _corrupt(path, rec.offset, f"record of cseq {rec.first_cseq}: {exc}") from exc
    if len(commands) != rec.count:
        raise _corrupt(
            path, rec.offset, f"record says {rec.count} commands, its frame holds {len(commands)}"
        )
    for cmd in commands:
        st.apply(state, cmd)


# --- files ------------------------------------------------------------------------


def lock_directory(directory: Path) -> int:
    """Hold ``directory``'s journal lock (an fd to close to release it), or
    raise :class:`JournalError` when another process holds it."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JournalError(
            f"{directory}: the journal directory is in use by another process (another "
            "broker node on this host?). Fix: give each node its own data directory, or "
            "stop the other one.",
            path=directory,
        ) from None
    return fd


def lock_held(directory: Path) -> bool:
    """A process (a running node) holds ``directory``'s journal lock; creates nothing."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def inspect_journal(directory: str | os.PathLike[str]) -> JournalReport:
    """What the journal in ``directory`` holds and whether a start would
    accept it, changing nothing (a torn tail is reported, not cut; nothing is
    created, deleted or renamed): every record's CRC is checked and the state
    rebuilt as a start would.  Raises :class:`JournalError` when there is no
    such directory.  Safe while a node runs (its last record may then be
    reported torn: it is being written)."""
    path = Path(directory)
    if not path.is_dir():
        raise JournalError(
            f"{path}: no journal directory there (a node started on it begins with an "
            "empty journal)",
            path=path,
        )
    files = [*_segment_paths(path), *_checkpoint_paths(path)]
    on_disk = sum(p.stat().st_size for p in files)
    torn: list[TornTail] = []
    checkpoint_cseq = last_cseq = 0
    damage: JournalError | None = None
    try:
        found = _scan(path, torn=torn)
        checkpoint_cseq = 0 if found.base is None else found.base.cseq
        last_cseq = found.chain[-1].end_cseq - 1 if found.chain else checkpoint_cseq
        if found.base is not None or found.chain:
            state, ckpt, _chain_used, _count = _rebuild(path, found, torn=torn)
            checkpoint_cseq, last_cseq = (0 if ckpt is None else ckpt.cseq), state.cseq
    except JournalError as exc:
        damage = exc
    return JournalReport(
        path,
        lock_held(path),
        checkpoint_cseq,
        last_cseq,
        on_disk,
        len(files),
        torn[0] if torn else None,
        damage,
    )


def _cseq_of(path: Path, prefix: str, suffix: str) -> int:
    try:
        return int(path.name[len(prefix) : -len(suffix)])
    except ValueError:
        raise _corrupt(path, 0, "file name does not hold a cseq") from None


def _segment_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{pj.SEGMENT_PREFIX}*{pj.SEGMENT_SUFFIX}"))


def _checkpoint_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{pj.CHECKPOINT_PREFIX}*{pj.CHECKPOINT_SUFFIX}"), reverse=True)


def _scan(directory: Path, *, torn: list[TornTail] | None = None) -> _Files:
    """The newest checkpoint whose header is good, and the chain after it
    (``torn``: see :func:`_chain`)."""
    checkpoints: list[_Checkpoint] = []
    for path in _checkpoint_paths(directory):
        cseq = _cseq_of(path, pj.CHECKPOINT_PREFIX, pj.CHECKPOINT_SUFFIX)
        with open(path, "rb") as f:
            head = f.read(pj.CHECKPOINT_HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
        try:
            info = pj.parse_checkpoint_header_untrusted(head)
        except RemoteProtocolError as exc:
            log.warning("journal.open checkpoint=bad file=%s error=%s", path, exc)
            continue
        if info.cseq != cseq or pj.checkpoint_size(info) != size:
            log.warning("journal.open checkpoint=bad file=%s error=size or cseq", path)
            continue
        checkpoints.append(_Checkpoint(path, cseq, size))
    base = checkpoints[0] if checkpoints else None
    return _Files(checkpoints, base, _chain(directory, base, torn=torn))


def _chain(
    directory: Path, base: _Checkpoint | None, *, torn: list[TornTail] | None = None
) -> list[_Segment]:
    """The segments after ``base`` (cseq 0 without one), each checked; the
    last one's torn tail is cut, or, given a ``torn`` list, only recorded
    there (nothing is written).  Raises :class:`JournalError` on damage."""
    after = 0 if base is None else base.cseq
    paths = [
        (p, c)
        for p in _segment_paths(directory)
        if (c := _cseq_of(p, pj.SEGMENT_PREFIX, pj.SEGMENT_SUFFIX)) > after
    ]
    chain: list[_Segment] = []
    expected = after + 1
    for k, (path, first) in enumerate(paths):
        if first != expected:
            before = (
                f"the segment before it ends at cseq {expected - 1}"
                if chain
                else f"checkpoint {after} is missing or damaged"
                if base is None and after
                else f"the checkpoint it follows is at cseq {after}"
                if base is not None
                else "no checkpoint covers the cseqs before it"
            )
            raise _corrupt(path, 0, f"segment starts at cseq {first}, but {before}")
        seg = _check_segment(path, first, last=k == len(paths) - 1, torn=torn)
        chain.append(seg)
        expected = seg.end_cseq
    return chain


def _check_segment(
    path: Path, first: int, *, last: bool, torn: list[TornTail] | None = None
) -> _Segment:
    data = path.read_bytes()
    if len(data) < pj.SEGMENT_HEADER_SIZE and last and torn is not None:
        torn.append(TornTail(path, 0, len(data), "the segment header is cut short"))
        return _Segment(path, first, first, 0)
    if len(data) < pj.SEGMENT_HEADER_SIZE and last:
        # Created, crashed before its header was on disk: start it again.
        log.warning("journal.open truncated=torn-header file=%s bytes=%d", path, len(data))
        with open(path, "wb") as f:
            f.write(pj.encode_segment_header(first))
            os.fsync(f.fileno())
        return _Segment(path, first, first, pj.SEGMENT_HEADER_SIZE)
    try:
        named = pj.decode_segment_header_untrusted(data)
    except RemoteProtocolError as exc:
        raise _corrupt(path, 0, str(exc)) from exc
    if named != first:
        raise _corrupt(path, 0, f"segment header says cseq {named}, its name {first}")
    offset = pj.SEGMENT_HEADER_SIZE
    expected = first
    while offset < len(data):
        try:
            rec = pj.next_record_untrusted(data, offset)
        except pj.RecordDamage as exc:
            if exc.cut and last and torn is not None:
                torn.append(TornTail(path, offset, len(data) - offset, str(exc)))
                break
            if exc.cut and last:
                _truncate(path, offset, len(data), str(exc))
                break
            raise _corrupt(path, offset, str(exc)) from exc
        if rec.first_cseq != expected:
            raise _corrupt(
                path, offset, f"record of cseq {rec.first_cseq} where cseq {expected} belongs"
            )
        expected += rec.count
        offset = rec.end
    return _Segment(path, first, expected, offset)


def _truncate(path: Path, offset: int, end: int, why: str) -> None:
    log.warning(
        "journal.open truncated=torn-tail file=%s offset=%d dropped_bytes=%d reason=%s",
        path,
        offset,
        end - offset,
        why,
    )
    with open(path, "r+b") as f:
        f.truncate(offset)
        os.fsync(f.fileno())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_file(path: Path, parts: list[bytes], sync: Callable[[int], None]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in parts:
            _write_all(fd, part)
        sync(fd)
    finally:
        os.close(fd)


def _sync_dir(directory: Path, durable: bool) -> None:
    if not durable:
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _delete_except(directory: Path, keep: set[Path], *, durable: bool) -> None:
    gone = [p for p in (*_segment_paths(directory), *_checkpoint_paths(directory)) if p not in keep]
    for path in gone:
        path.unlink()
    if gone:
        _sync_dir(directory, durable)
