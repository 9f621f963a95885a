"""The spool's state: its file, its statistics, the provenance of its directory.

Theory of operation
-------------------
``spool.state`` (JSON) holds the :class:`Watermarks` of a spool directory
(gateway/spool.py says what they mean), with the incarnation of the site
whose stream numbered its events.  It is written to a temporary file and
renamed, so a crash leaves the old or the new one, never a mix.

A spool serves one incarnation's stream in one on-disk format.  What a
directory holds from another incarnation (a whole site restarted with a new
one), in another format (an older drgate), or without a state file (nobody
can say what it is) is never replayed: :func:`set_aside` moves it into a
subfolder ``set-aside-<incarnation>-<timestamp>`` (a rename: same file
system, nothing copied), where it stays for inspection until an operator
deletes it, and the spool starts empty.

*Whole-site recoveries.*  The state also records how many whole-site
recoveries the site had when the spool was written (``recovery``).  A
recovery continues from the most advanced broker journal, cseq C: a spool
may hold events above C that no broker journaled, which the site's history
then numbered anew.  A spool written before a recovery it did not see is
kept only if it holds nothing above the lowest C of the recoveries since
(:func:`lost_history`); else it is set aside like another incarnation's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from gateway import spoolfile as sf
from gateway.spoolfile import LOCK_FILE, SpoolCorruptError

log = logging.getLogger("gateway.spool")

STATE_FILE: Final = "spool.state"
# 2: the incarnation; 3: the recovery count.  A state of version 2 reads as
# written before any recovery; of another version it is set aside with its segments.
STATE_VERSION: Final = 3
_READABLE_VERSIONS: Final = (2, STATE_VERSION)
SET_ASIDE_PREFIX: Final = "set-aside-"


@dataclass(slots=True)
class Watermarks:
    """What the spool persists in ``spool.state`` (see gateway/spool.py for the meaning)."""

    floor: int  # every event above it is in the spool
    trimmed_upto: int  # ack watermark
    incarnation: int = 0  # the site incarnation whose stream numbered the events
    lost_upto: int | None = None  # highest seq a loss (overflow, gap, failed write) took
    first_lost_seq: int | None = None  # lowest seq of the current loss episode
    overflow_count: int = 0  # segments dropped because the spool was full (ever)
    overflow_events: int = 0  # events dropped with them (ever)
    recovery: int = 0  # whole-site recoveries the site had had when its events were written

    def lose(self, first: int, last: int, overflow_events: int | None = None) -> None:
        """Events ``first..last`` are not in the spool: raise the floor past them.
        ``overflow_events`` (an upper bound when the head is partly acked) counts an overflow."""
        if self.lost_upto is None or self.lost_upto <= self.trimmed_upto:
            self.first_lost_seq = first  # a new loss episode
        self.lost_upto = last if self.lost_upto is None else max(self.lost_upto, last)
        self.floor = max(self.floor, last)
        if overflow_events is not None:
            self.overflow_count += 1
            self.overflow_events += overflow_events

    def join(
        self, directory: Path, start_after: int | None, recoveries: Sequence[int] | None
    ) -> bool:
        """A sidecar opens the spool at the join point ``start_after`` in a
        site that had ``len(recoveries)`` whole-site recoveries: record that
        count, raise the floor to the join point (logged); whether they changed."""
        changed = False
        if recoveries is not None and len(recoveries) != self.recovery:
            self.recovery, changed = len(recoveries), True  # written under it from now on
        if start_after is not None and start_after > self.floor:
            log.warning(
                "spool.open dir=%s floor=%d raised_to=%d reason=join-point-above-floor "
                "(what went by while this sidecar was down: D resyncs if it needs it)",
                *(directory, self.floor, start_after),
            )
            self.floor, changed = start_after, True
        return changed

    @property
    def overflowed(self) -> bool:
        """Events D had not applied were lost, and D has not been resynced past them."""
        return self.lost_upto is not None and self.trimmed_upto < self.lost_upto


class OtherFormat(Exception):
    """The state file is of another version; ``version`` says which."""

    def __init__(self, version: object) -> None:
        super().__init__(f"state file version {version!r}")
        self.version = version


def load_state(directory: Path) -> Watermarks | None:
    """The persisted watermarks, or ``None`` for a new spool.

    Raises :class:`OtherFormat` for a state of another version, and
    :class:`SpoolCorruptError` if the file cannot be read as a state.
    """
    state_path = directory / STATE_FILE
    (directory / (STATE_FILE + ".tmp")).unlink(missing_ok=True)  # a crash's leftover
    try:
        text = state_path.read_text()
    except FileNotFoundError:
        return None
    try:
        state = json.loads(text)
        if state.get("version") not in _READABLE_VERSIONS:
            raise OtherFormat(state.get("version"))
        return Watermarks(
            floor=int(state["floor"]),
            trimmed_upto=int(state["trimmed_upto"]),
            incarnation=int(state["incarnation"]),
            lost_upto=_int_or_none(state["lost_upto"]),
            first_lost_seq=_int_or_none(state["first_lost_seq"]),
            overflow_count=int(state["overflow_count"]),
            overflow_events=int(state["overflow_events"]),
            recovery=int(state.get("recovery", 0)),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SpoolCorruptError(state_path, 0, f"unreadable state file ({exc})") from None


def _int_or_none(value: Any) -> int | None:
    if value is None:
        return None
    return int(value)


def save_state(directory: Path, marks: Watermarks, sync: Callable[[int], None] | None) -> None:
    """Write ``marks`` to a temporary file, ``sync(fd)`` it if given, and rename it in place.

    The caller syncs the directory afterwards if the rename must survive a power loss.
    """
    tmp = directory / (STATE_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = json.dumps({"version": STATE_VERSION, **asdict(marks)}).encode() + b"\n"
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        if sync is not None:
            sync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / STATE_FILE)


def set_aside(directory: Path, label: str, why: str) -> Path:
    """Move everything in ``directory`` but the lock and earlier set-asides into
    a new subfolder named after ``label`` (the old incarnation); returns it.

    The state file goes first: a crash half-way leaves segments without a
    state, which the next open sets aside as well.
    """
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = directory / f"{SET_ASIDE_PREFIX}{label}-{stamp}"
    n = 0
    while target.exists():
        n += 1
        target = directory / f"{SET_ASIDE_PREFIX}{label}-{stamp}.{n}"
    target.mkdir()
    entries = sorted(
        (p for p in directory.iterdir() if p.name != LOCK_FILE and p != target),
        key=lambda p: p.name != STATE_FILE,
    )
    for path in entries:
        if not path.name.startswith(SET_ASIDE_PREFIX):
            path.rename(target / path.name)
    log.warning(
        "spool.set_aside dir=%s moved_to=%s reason=%s; its events are never replayed "
        "(D resyncs if it needs them). Fix: inspect it if you wish, then delete it",
        directory,
        target,
        why,
    )
    return target


def provenance(directory: Path, incarnation: int | None) -> tuple[Watermarks | None, str]:
    """The persisted marks (``None`` for a new spool) and why the directory's
    content may not be kept ("" when it may): another format, another
    incarnation (``incarnation`` ``None`` accepts any), or segments without
    a state.  Raises :class:`SpoolCorruptError` for an unreadable state."""
    try:
        marks = load_state(directory)
    except OtherFormat as exc:
        return None, f"{STATE_FILE} of format {exc.version}, this drgate's is {STATE_VERSION}"
    paths = sf.segment_paths(directory)
    if marks is None:
        return None, "segments without a state file" if paths else ""
    if incarnation is not None and marks.incarnation != incarnation:
        return marks, f"incarnation {marks.incarnation}, the site's is {incarnation}"
    for path in paths:
        found = sf.read_preamble(path)
        if found is not None and found != (sf.VERSION, marks.incarnation):
            return marks, f"segment {path.name} of format {found[0]} incarnation {found[1]}"
    return marks, ""


def lost_history(
    marks: Watermarks, held_upto: int, start_after: int | None, recoveries: Sequence[int] | None
) -> str:
    """Why a spool whose marks are ``marks``, holding events up to
    ``held_upto``, holds another history than the site's ("" when it does
    not): events above a whole-site recovery it missed (``recoveries``: the
    cseq each of the site's recoveries continued from, oldest first;
    ``None`` does not check), or above the join point ``start_after``."""
    if recoveries is not None:
        if marks.recovery > len(recoveries):
            return (
                f"it was written after whole-site recovery {marks.recovery}, "
                f"the site had {len(recoveries)}"
            )
        missed = recoveries[marks.recovery :]
        if missed and held_upto > min(missed):
            number = marks.recovery + 1 + missed.index(min(missed))
            return (
                f"it holds seq {held_upto}, spooled before whole-site recovery {number}, "
                f"which continued from cseq {min(missed)}: what lies above never happened "
                "in the site's history"
            )
    if start_after is not None and start_after < held_upto:
        return f"it holds seq {held_upto}, above the join point {start_after}"
    return ""


@dataclass(frozen=True, slots=True)
class SpoolStatistics:
    """A snapshot for metrics and ``/status``."""

    bytes: int  # on disk, all segments
    segments: int
    records: int  # on disk, including acked ones not yet trimmed away
    first_seq: int | None  # first record on disk
    last_seq: int | None  # last record appended
    floor: int  # every event above it is in the spool
    held_upto: int  # the spool holds (floor, held_upto] without a gap
    incarnation: int  # of the stream the events belong to
    trimmed_upto: int  # ack watermark
    overflowed: bool  # events D had not applied were lost; D needs a resync
    needs_resync: bool  # the spool cannot serve D at its last ack
    overflow_count: int  # segments dropped because the spool was full (ever)
    overflow_events: int  # events dropped with them (ever, unacked ones only)
    first_lost_seq: int | None  # lowest seq that may have been lost in the current loss
    lost_upto: int | None  # highest seq lost
    appended: int  # events appended since open
    skipped_acked: int  # appended events at or below the watermark, not stored
    write_errors: int  # failed writes since open (each cost the events of a batch)
    fsyncs: int  # fdatasync calls since open
    max_bytes: int
    fsync: str
