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

*Group commit.*  A committer task writes what was appended with one
``fdatasync`` (``fsync: batch``) in a worker thread while the applier goes on
appending, so one fsync covers every frame delivered meanwhile.  It commits
at once when a publish waits to be settled here; when none does (the
commands came from other nodes' clients, or are ``Durable`` reports), it lets
frames gather for up to ``LAZY_COMMIT_S`` first, or until a publish comes to
wait.  Only the settling node's disk is in a hurry: a commit costs every node
CPU (the worker thread, the fdatasync), and without this a node whose
clients publish made its peers commit as often as itself.

*What is journaled.*  Every command, but a message that is not persistent
(transient, or on a non-durable queue: cluster/state/persistence.py) without
its body, so the replay keeps every cseq and position and a whole-site
recovery then drops it.

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from cluster.bus import MemberId
from cluster.journal import Journal, JournalStatistics
from cluster.member import SiteMember
from cluster.state.persistence import for_journal
from protocol import cluster as pc

log = logging.getLogger(__name__)

# How long a node with no publish waiting to settle lets frames gather before
# it commits them (the module docstring, "Group commit").
LAZY_COMMIT_S = 0.01


@dataclass(frozen=True, slots=True)
class JournalSettings:
    """``journal:`` of a broker's config."""

    directory: str
    fsync: str = "batch"
    checkpoint_bytes: int = 64 << 20


class NodeJournal:
    """One node's journal, driven by the node's member hooks."""

    def __init__(self, settings: JournalSettings, member: SiteMember, node: int) -> None:
        self.settings = settings
        self.member = member
        self.node = node
        self.journal = Journal.open(
            settings.directory, fsync=settings.fsync, checkpoint_bytes=settings.checkpoint_bytes
        )
        self._started = False  # the journal follows the site's state
        self._frame: list[pc.Command] = []
        self._frame_first = 0
        self._unsettled: deque[tuple[int, Callable[[], None]]] = deque()
        self._last_real = 0  # cseq of the last command other than a Durable
        self._posted = 0  # the last durable cseq multicast
        self._wanted = trio.Event()

    def recover(self) -> None:
        """Before joining: what the journal holds becomes the member's
        candidate for a whole-site recovery."""
        got = self.journal.recover()
        if got is None:
            log.info("journal %s is empty", self.settings.directory)
            return
        log.info(
            "journal %s recovered cseq %d (checkpoint %d, %d frames replayed in %.2f s)",
            self.settings.directory,
            got.cseq,
            got.checkpoint_cseq,
            got.frames_replayed,
            got.seconds,
        )
        self.member.recovered = got.state

    # -- member hooks ---------------------------------------------------------------

    def after_command(self, cmd: pc.Command) -> None:
        if isinstance(cmd, pc.Recovering | pc.RecoveryChunk):
            return  # the site's recovery, not its history (the state it chose is checkpointed)
        state = self.member.state
        if not self._started:
            if state.incarnation != 0:
                self._checkpoint()  # the first command of a live site: start from here
            return
        if not self._frame:
            self._frame_first = state.cseq
        self._frame.append(for_journal(state, cmd))
        if not isinstance(cmd, pc.Durable):
            self._last_real = state.cseq

    def after_frame(self) -> None:
        if self._frame:
            self.journal.append(self._frame_first, self._frame)
            self._frame = []
            self._wanted.set()

    def after_view(self, left: Sequence[MemberId]) -> None:
        if self._started and left:
            self.journal.append_members_left(left)
            self._wanted.set()

    def after_restore(self) -> None:
        """A snapshot (or the recovery) replaced the state: the journal starts
        again from it."""
        self._frame = []
        if self.member.state.incarnation != 0:
            self._checkpoint()

    def settle_when_durable(self, settle: Callable[[], None]) -> None:
        """Call ``settle`` once the command just applied is on disk here."""
        self._unsettled.append((self.member.state.cseq, settle))
        self._wanted.set()

    # -- the committer ---------------------------------------------------------------

    async def run(self) -> None:
        """Group commits, settlements, checkpoints, Durable reports; never returns."""
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            if not self._unsettled:
                with trio.move_on_after(LAZY_COMMIT_S):
                    while not self._unsettled:  # a publish to settle ends the wait
                        await self._wanted.wait()
                        self._wanted = trio.Event()
            durable = await trio.to_thread.run_sync(self.journal.commit)
            if self.journal.needs_checkpoint:
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
        self.journal.close()
