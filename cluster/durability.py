"""A broker node's journal at work: what it writes, when a publish is settled,
and what the site learns of it (docs/broker.md, "Durability").

Theory of operation
-------------------
A node with ``journal:`` in its config opens its journal (cluster/journal.py)
before it joins the bus and recovers what it holds; the bus member takes that
state to the site's recovery when the site starts with no member alive
(cluster/member.py, ``Recovering``).  From the point the node holds the
site's state (the first command of a live site, or a snapshot that replaced
its state), the journal starts again from a checkpoint of that state, and
then every command the node applies is appended in stream order, with the
view changes that released a departed member's messages.

*Group commit.*  A committer thread of the node's own (:class:`CommitThread`)
writes what was appended with one ``fdatasync`` (``fsync: batch``) while the
applier goes on appending, so one fsync covers every frame delivered
meanwhile; when asked again during a commit it commits again as soon as that
one is done, without a round trip through trio, and it hands each result to
trio with the run's token (``run_sync_soon``): a commit costs the write, the
fdatasync and two thread wake-ups, nothing more.  The applier asks for a
commit at once, from ``after_frame``, when a publish waits to be settled
here; when none does (the commands came from other nodes' clients, or are
``Durable`` reports), the committer task lets frames gather for up to
``LAZY_COMMIT_S`` first, or until a publish comes to wait.  Only the settling
node's disk is in a hurry: a commit costs every node CPU (the wake-ups, the
fdatasync), and without this a node whose clients publish made its peers
commit as often as itself.

*What is journaled.*  Every command, but a message that is not persistent
(transient, or on a non-durable queue: cluster/state/persistence.py) without
its body, so the replay keeps every cseq and position and a whole-site
recovery then drops it.  A delivered frame journaled whole and unchanged (no
body elided, no command left out) is journaled as the bytes the bus
delivered (``SiteMember.delivered_frame``), not encoded again.

*Settlement.*  A persistent message's publish from one of this node's
clients is settled once the commit that covers its command is done (any
other publish at once, after it is applied): the message is then on the disk of
the node its client is connected to.  That node is the one that can tell the
client without another round trip, and the site's recovery always continues
from the most advanced journal, so a settled message survives any restart of
the whole site.

*The site's durable watermark.*  After a commit that covered commands other
than ``Durable`` reports, the node multicasts ``Durable(node, cseq)`` unless
the site's watermark is already there (the state keeps the highest report,
so a lower one would change nothing but cost the bus a command and every
node an append).  P's egress forwards nothing above the watermark, so D
never holds an event the primary could lose in a power cut (R1 stays exact
after a whole-site recovery).  A publish's watermark moves with its settling
node's commit; a command no node settles (an accept, a sidecar's command)
reaches it within ``LAZY_COMMIT_S`` and a commit.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from cluster.bus import MemberId
from cluster.journal import DEFAULT_CHECKPOINT_INTERVAL_S, Journal, JournalStatistics
from cluster.member import SiteMember
from cluster.state.persistence import for_journal
from protocol import cluster as pc

log = logging.getLogger(__name__)

# How long a node with no publish waiting to settle lets frames gather before
# it commits them (the module docstring, "Group commit").
LAZY_COMMIT_S = 0.01
# How long closing the journal waits for a commit under way (one fdatasync).
CLOSE_WAIT_S = 10.0

# What a commit handed back: the durable cseq, or the error it raised.
Committed = Callable[[int, BaseException | None], None]


@dataclass(frozen=True, slots=True)
class JournalSettings:
    """``journal:`` of a broker's config."""

    directory: str
    fsync: str = "batch"
    checkpoint_bytes: int = 64 << 20
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S


class CommitThread:
    """A thread that commits ``journal`` each time it is asked (:meth:`ask`),
    once per burst of asks: an ask during a commit makes one more commit right
    after it.  Each result goes to ``committed`` on the trio thread (the token
    of the run that called :meth:`start`).  After an error it stops (the node
    stops too: ``NodeJournal.run`` raises it)."""

    def __init__(self, journal: Journal, committed: Committed) -> None:
        self._journal = journal
        self._committed = committed
        self._cond = threading.Condition()
        self._asked = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (from trio)."""
        token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(
            target=self._serve, args=(token,), name="journal-commit", daemon=True
        )
        self._thread.start()

    def ask(self) -> None:
        """Commit what is appended by now (never waits for a commit)."""
        with self._cond:
            self._asked = True
            self._cond.notify()

    def stop(self) -> None:
        """No more commits after the one under way (never waits for it)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the thread, once stopped, to end."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _serve(self, token: trio.lowlevel.TrioToken) -> None:
        while True:
            with self._cond:
                while not (self._asked or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    return
                self._asked = False
            error: BaseException | None = None
            durable = 0
            try:
                durable = self._journal.commit()
            except BaseException as exc:  # JournalError, or a bug: the node raises it
                error = exc
            try:
                token.run_sync_soon(self._committed, durable, error)
            except trio.RunFinishedError:
                return
            if error is not None:
                return


class NodeJournal:
    """One node's journal, driven by the node's member hooks."""

    def __init__(self, settings: JournalSettings, member: SiteMember, node: int) -> None:
        self.settings = settings
        self.member = member
        self.node = node
        self.journal = Journal.open(
            settings.directory,
            fsync=settings.fsync,
            checkpoint_bytes=settings.checkpoint_bytes,
            checkpoint_interval_s=settings.checkpoint_interval_s,
        )
        self._started = False  # the journal follows the site's state
        self._frame: list[pc.Command] = []
        self._frame_first = 0
        self._seen = 0  # commands of the delivered frame so far
        self._verbatim = True  # every one of them journaled unchanged
        self._unsettled: deque[tuple[int, Callable[[], None]]] = deque()
        self._last_real = 0  # cseq of the last command other than a Durable
        self._posted = 0  # the last durable cseq multicast
        self._committer = CommitThread(self.journal, self._committed)
        self._asked_upto = 0  # the state's cseq at the last ask
        self._dirty = False  # appended since the last ask
        self._lazy_at = math.inf  # when the committer task asks for the dirty records
        self._results: deque[tuple[int, BaseException | None]] = deque()
        self._wake = trio.Event()  # dirty, or a result came

    def recover(self) -> None:
        """Before joining: what the journal holds becomes the member's
        candidate for a whole-site recovery."""
        got = self.journal.recover()
        if got is None:
            log.info("journal %s is empty", self.settings.directory)
            return
        log.info(
            "journal %s recovered cseq %d (checkpoint %d of %d bytes, %d frames replayed in "
            "%.2f s: %.2f s to rebuild, the rest to clean up; %.2f s of CPU)",
            self.settings.directory,
            got.cseq,
            got.checkpoint_cseq,
            got.checkpoint_bytes,
            got.frames_replayed,
            got.seconds,
            got.rebuild_seconds,
            got.cpu_seconds,
        )
        self.member.recovered = got.state

    # -- member hooks ---------------------------------------------------------------

    def after_command(self, cmd: pc.Command) -> None:
        self._seen += 1
        if isinstance(cmd, pc.RecoveryChunk):
            self._verbatim = False
            return  # the recovery's state is checkpointed (after_restore), not its chunks
        state = self.member.state
        if not self._started:  # a report of a site still recovering is not journaled either
            self._verbatim = False
            if state.incarnation != 0:
                self._checkpoint()  # the first command of a live site: start from here
            return
        if not self._frame:
            self._frame_first = state.cseq
        journaled = for_journal(state, cmd)
        self._verbatim = self._verbatim and journaled is cmd
        self._frame.append(journaled)
        if not isinstance(cmd, pc.Durable):
            self._last_real = state.cseq

    def after_frame(self) -> None:
        if self._frame:
            if self._verbatim and len(self._frame) == self._seen:
                # The delivered bytes are this very frame: no encoding again.
                frame = self.member.delivered_frame
                self.journal.append_frame(self._frame_first, frame, self._seen)
            else:
                self.journal.append(self._frame_first, self._frame)
            self._frame = []
            self._appended()
        self._seen = 0
        self._verbatim = True

    def after_view(self, left: Sequence[MemberId]) -> None:
        if self._started and left:
            self.journal.append_members_left(left)
            self._appended()

    def on_rejoin(self) -> None:
        """The state is stale (a rejoin, or a site starting over): nothing is
        journaled until a snapshot or the recovery replaces it."""
        self._started = False
        self._frame = []
        self._seen = 0
        self._verbatim = True

    def after_restore(self) -> None:
        """A snapshot (or the recovery) replaced the state: the journal starts
        again from it."""
        self._frame = []
        self._verbatim = False  # mid-frame (a RecoveryChunk): the rest is encoded
        if self.member.state.incarnation != 0:
            self._checkpoint()

    def settle_when_durable(self, settle: Callable[[], None]) -> None:
        """Call ``settle`` once the command just applied is on disk here (its
        frame is committed at once, after ``after_frame`` appends it)."""
        self._unsettled.append((self.member.state.cseq, settle))

    # -- the committer ---------------------------------------------------------------

    def _appended(self) -> None:
        """Records were appended: ask for a commit now if a publish waits for
        them, else let the committer task's lazy deadline do it."""
        if self._unsettled and self._unsettled[-1][0] > self._asked_upto:
            self._ask()
        elif not self._dirty:
            self._dirty = True
            self._wake.set()

    def _ask(self) -> None:
        self._dirty = False
        self._lazy_at = math.inf
        self._asked_upto = self.member.state.cseq
        self._committer.ask()

    def _committed(self, durable: int, error: BaseException | None) -> None:
        """From the committer thread, on the trio thread."""
        self._results.append((durable, error))
        self._wake.set()

    async def run(self) -> None:
        """Lazy commits, settlements, checkpoints, Durable reports; never
        returns.  Raises the :class:`~cluster.journal.JournalError` of a
        failed commit.  Closes the journal when it ends (cancelled: the
        node stops), which releases the directory's lock."""
        self._committer.start()
        try:
            while True:
                if self._dirty and self._lazy_at == math.inf:
                    self._lazy_at = trio.current_time() + LAZY_COMMIT_S
                with trio.move_on_at(self._lazy_at):
                    await self._wake.wait()
                self._wake = trio.Event()
                if self._dirty and trio.current_time() >= self._lazy_at:
                    self._ask()
                while self._results:
                    durable, error = self._results.popleft()
                    if error is not None:
                        raise error
                    self._after_commit(durable)
        finally:
            self.close()

    def _after_commit(self, durable: int) -> None:
        # Not while the state is stale or empty (a rejoin, a start-over): the
        # journal keeps what it holds until a snapshot or the recovery.
        if self._started and self.journal.needs_checkpoint:
            self._checkpoint()
            durable = self.member.state.cseq
        self._settle(durable)
        self._report(durable)

    def _report(self, durable: int) -> None:
        """Multicast ``Durable`` if the commits since the last report covered
        commands other than reports and it takes the site's watermark on."""
        if self._last_real <= self._posted:
            return
        if durable <= max(self._posted, self.member.state.durable_cseq):
            return
        self._posted = durable
        self.member.post(pc.Durable(self.node, durable))

    def _checkpoint(self) -> None:
        state = self.member.state
        self.journal.checkpoint(state)
        self._started = True
        self._settle(state.cseq)

    def _settle(self, durable: int) -> None:
        while self._unsettled and self._unsettled[0][0] <= durable:
            _cseq, settle = self._unsettled.popleft()
            settle()

    def statistics(self) -> JournalStatistics:
        return self.journal.statistics()

    def close(self) -> None:
        """Stop the committer thread, wait for a commit under way, close the journal."""
        self._committer.stop()
        self._committer.join(CLOSE_WAIT_S)
        self.journal.close()
