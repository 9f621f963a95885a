"""Who in a site's view holds the state, who gives it to a joiner, and when.

Theory of operation
-------------------
Every member (broker or sidecar) keeps the whole site state and applies the
bus stream.  A member that joins a live site has no state: it *buffers* the
events it delivers from its join view on, until a *donor* sends it a snapshot
cut at a known point of the stream; it then drops the buffered events the
snapshot already contains and applies the rest.

The point of the cut is counted in *events* (deliveries and view changes)
since the view change that added the joiner.  Virtual synchrony gives every
member that survives a view change the same events from there on, so the
donor and the joiner count the same events and agree on the cut without
exchanging anything else.

Rules, applied identically by every member from the same stream:

* **Genesis.** A view in which every member is new (nobody survived from an
  earlier view) starts a site from nothing: every member of that view is ready
  with the empty state, and the lowest one multicasts ``Genesis`` with a fresh
  incarnation.  The same holds for a joiner whose older members (those in the
  view before it) have all left before it got a snapshot: the site's state is
  gone with them, and the joiner starts a new incarnation with the others of
  its cohort (those that joined in the same view); a durable site recovers
  instead, and a rejoiner sets the stale state it still holds aside as a
  recovery candidate (``start_over``), never builds on it.
* **Ready set.** Members become ready at genesis or when their
  ``MemberReady`` command is delivered; they leave the set when they leave the
  view.  The ready set as of the cut travels in the snapshot.
* **What the joiner has.** Right after the view that added it, while it
  buffers, a joiner multicasts ``JoinHave``: what its journal holds (nothing
  for a member without one).  Every member notes the last ``JoinHave`` of
  each joiner as it is delivered (also while itself buffering), and forgets
  it when the joiner leaves.
* **Donor.** The lowest ready member of a quorate view among those that saw
  a joiner's join view (its *witnesses*: only they count the joiner's events
  from where it does, so only they can cut its snapshot; a member that joined
  after it cannot, even once it is ready and the lowest of all) sends a
  snapshot to every member of the view that is not ready, whose ``JoinHave``
  it has seen and that it has not served yet: so the donation happens when
  the donor applies the joiner's ``JoinHave`` (after the whole frame that holds it),
  still counted in events since the join view.  When a donor leaves
  mid-transfer, the next lowest takes over at the view change that removed
  it, with the ``JoinHave`` it already saw, and sends a new snapshot; the
  joiner takes the first complete one.  A joiner whose ``JoinHave`` never
  comes (it left) is forgotten with the view that removed it.  A second
  ``JoinHave`` of the same joiner (an empty one: its journal could not fill
  a delta) makes the donor serve it again.

* **Waiting members say it again.**  At every view change a member still
  waiting for a snapshot multicasts its ``JoinHave`` again (the same one: a
  donor that already served it does not serve it twice).
* **Start over.**  When every member of a quorate view has multicast a
  ``JoinHave`` since the last view change and none a ``MemberReady``, nobody
  in the view holds the site state: a partition left no side quorate and
  every member rejoined at the merge, so no donor will ever come.  Every
  member decides it at the same delivery (virtual synchrony) and the site
  starts as after a whole-site restart (``StartGenesis(start_over=True)``):
  the state each member held becomes its broker's candidate beside its
  journal (cluster/member.py).

* **Transfer.** The donor's snapshot travels in ``StateChunk`` commands
  addressed to the joiner; a transfer is named by its donor *and* the donor's
  transfer number (the numbers are each donor's own count), and a chunk of
  index 0 starts a transfer over (a new donor took over).

This module is pure: :class:`Membership` takes view changes, ``MemberReady``
and ``JoinHave`` commands and answers what to do, :class:`SnapshotAssembly` puts a transfer's
chunks together; the bus member (:mod:`cluster.member`) does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.bus.contract import MemberId, ViewChange
from protocol.cluster import JoinHave, StateChunk


@dataclass(frozen=True, slots=True)
class SendSnapshot:
    """Send a snapshot to ``target``, cut here; ``cut`` is the number of the
    joiner's events the snapshot already covers."""

    target: MemberId
    cut: int
    have: JoinHave | None = None


@dataclass(frozen=True, slots=True)
class AnnounceHave:
    """This member joined a live site: multicast its ``JoinHave`` now;
    ``again``: the one it multicast last (a view changed while it waits)."""

    again: bool = False


@dataclass(frozen=True, slots=True)
class Rejoin:
    """This member's state is stale: it was in a minority partition while the
    quorate part of the site went on.  Drop the state and join again as a
    new member (buffer, announce an empty ``JoinHave``, then take a snapshot
    from a donor of the majority)."""


@dataclass(frozen=True, slots=True)
class StartGenesis:
    """Start from the empty state here; ``announce`` says whether this member
    multicasts the ``Genesis`` command (the lowest of the cohort does);
    ``start_over``: nobody in the view held the state (module docstring,
    "Start over"), so what this member held is set aside as a candidate."""

    announce: bool
    start_over: bool = False


Action = SendSnapshot | StartGenesis | Rejoin | AnnounceHave


@dataclass(slots=True)
class Membership:
    """One member's view of the site's membership (see the module docstring)."""

    me: MemberId
    ready: set[MemberId] = field(default_factory=set)
    members: tuple[MemberId, ...] = ()
    quorate: bool = True
    is_ready: bool = False
    # Events delivered since my own join view (the join view itself is 0).
    events: int = 0
    # For members I saw join: my event count just after their join view.
    joined_at: dict[MemberId, int] = field(default_factory=dict)
    # For the same members: the members of the view that added them (those
    # that can cut a snapshot for them; module docstring, "Donor").
    witnesses: dict[MemberId, frozenset[MemberId]] = field(default_factory=dict)
    # While not ready: the members that were there before me, and my cohort.
    older: set[MemberId] = field(default_factory=set)
    cohort: set[MemberId] = field(default_factory=set)
    served: set[MemberId] = field(default_factory=set)
    # The last JoinHave of each member not yet ready (a donor waits for it).
    haves: dict[MemberId, JoinHave] = field(default_factory=dict)
    # Ready members that left my view: if they come back while my view was
    # not quorate, they went on without me and my state is stale.
    departed_ready: set[MemberId] = field(default_factory=set)
    # I was ready in a view without quorum since then.
    minority_seen: bool = False
    # Since the last view change: who multicast a JoinHave, and whether
    # anyone a MemberReady (module docstring, "Start over").
    announced: set[MemberId] = field(default_factory=set)
    ready_announced: bool = False
    # I rejoined and still hold the state I had (until a snapshot replaces it).
    stale: bool = False
    _joined: bool = False

    def on_view(self, view: ViewChange) -> list[Action]:
        """A view change was delivered; what this member must do now."""
        self.members = view.members
        self.quorate = view.quorate
        self.announced.clear()
        self.ready_announced = False
        returned = set(view.joined) & self.departed_ready
        if self._joined and self.is_ready and returned and self.minority_seen:
            # A partition healed and I was on the side without quorum while
            # the members now returning went on: my state is stale.  Decided
            # at the merge view itself (the agreed point every member of the
            # other side also sees), whatever quorum flag it carries.
            self.is_ready = False
            self.minority_seen = False
            self.events = 0
            self.ready.clear()
            self.served.clear()
            self.haves.clear()
            self.departed_ready.clear()
            self.joined_at = dict.fromkeys(view.members, 0)
            self.witnesses = dict.fromkeys(view.members, frozenset(view.members))
            self.older = set(view.joined)
            self.cohort = set(view.members) - set(view.joined)
            self.stale = True
            return [Rejoin()]
        if self._joined and self.is_ready and not view.quorate:
            self.minority_seen = True
        if not self._joined:
            self._joined = True
            self.events = 0
            for m in view.joined:
                self.joined_at[m] = 0
                self.witnesses[m] = frozenset(view.members)
            self.cohort = set(view.joined)
            self.older = set(view.members) - set(view.joined)
            if not self.older:
                return self._genesis(set(view.members))
            return [AnnounceHave()]
        self.events += 1
        for m in view.left:
            if m in self.ready:
                self.departed_ready.add(m)
            self.ready.discard(m)
            self.served.discard(m)
            self.haves.pop(m, None)
            self.joined_at.pop(m, None)
            self.witnesses.pop(m, None)
            self.older.discard(m)
            self.cohort.discard(m)
        for m in view.joined:
            self.joined_at[m] = self.events
            self.witnesses[m] = frozenset(view.members)
        if not self.is_ready:
            if not self.older:
                return self._genesis(self.cohort & set(view.members))
            return [AnnounceHave(again=True)]
        return self._donations()

    def on_delivery(self) -> None:
        """Count a delivery (any frame) in the event stream."""
        self.events += 1

    def on_member_ready(self, member: MemberId, *, live: bool = True) -> None:
        """``member``'s ``MemberReady`` was delivered (``live``), or is replayed
        from what this member buffered (which says nothing of the view now)."""
        if member in self.members:
            self.ready.add(member)
            self.haves.pop(member, None)
            self.ready_announced = self.ready_announced or live

    def on_join_have(self, member: MemberId, have: JoinHave) -> list[Action]:
        """``member``'s ``JoinHave`` was delivered (call it at delivery, after
        :meth:`on_delivery` and, when this member applies the stream, after
        the whole frame is applied: the cut is there, and a ``MemberReady`` of
        the same frame counts before it).  Whether nobody holds the state is
        decided from the stream alone, the same at every member of the view,
        whether it holds the state itself or not."""
        if member not in self.members:
            return []
        self.announced.add(member)
        if self.quorate and not self.ready_announced and self.announced >= set(self.members):
            return self._start_over()
        if member in self.ready:
            return []
        if self.haves.get(member) != have:
            self.served.discard(member)  # a different one asks again
        self.haves[member] = have
        if not self.is_ready:
            return []
        return self._donations()

    def on_restored(self, ready: set[MemberId], members: tuple[MemberId, ...]) -> None:
        """My snapshot is applied: I know the donor's ready set as of the cut."""
        self.is_ready = True
        self.ready = {m for m in ready if m in self.members}
        self.older.clear()
        self.stale = False

    def donor(self) -> MemberId | None:
        """The lowest ready member of the view, or ``None`` (no quorum, or nobody)."""
        if not self.quorate or not self.ready:
            return None
        return min(self.ready)

    def donor_for(self, target: MemberId) -> MemberId | None:
        """Who donates to ``target``: the lowest ready member that saw it join
        (module docstring, "Donor"), or ``None`` (no quorum, nobody, or I did
        not see it join myself: then I am not its donor either)."""
        candidates = self.ready & self.witnesses.get(target, frozenset())
        if not self.quorate or not candidates:
            return None
        return min(candidates)

    def cut_for(self, target: MemberId) -> int | None:
        at = self.joined_at.get(target)
        return None if at is None else self.events - at

    def _genesis(self, cohort: set[MemberId]) -> list[Action]:
        self.is_ready = True
        self.ready = set(cohort) | {self.me}
        self.older.clear()
        # A rejoiner still holds its stale state: it goes aside, as in a start-over.
        start = StartGenesis(announce=self.me == min(self.ready), start_over=self.stale)
        self.stale = False
        return [start, *self._donations()]

    def _start_over(self) -> list[Action]:
        """Nobody in this quorate view holds the state (module docstring,
        "Start over"): every member of it starts the site again."""
        self.is_ready = True
        self.ready = set(self.members)
        self.minority_seen = False
        self.stale = False
        for waiting in (self.older, self.cohort, self.served, self.departed_ready, self.announced):
            waiting.clear()
        self.haves.clear()
        return [StartGenesis(announce=self.me == min(self.members), start_over=True)]

    def _donations(self) -> list[Action]:
        actions: list[Action] = []
        for m in self.members:
            if m in self.ready or m in self.served or m not in self.haves:
                continue
            cut = self.cut_for(m)
            if cut is None or self.donor_for(m) != self.me:
                # Another member donates; or it joined before I did, so an
                # older member holds its join point and is its donor (a
                # lower member that joined after it, as I did, is not).
                continue
            self.served.add(m)
            actions.append(SendSnapshot(m, cut, self.haves[m]))
        return actions


@dataclass(slots=True)
class SnapshotAssembly:
    """The chunks of the state transfer a joining member ``me`` is taking."""

    me: MemberId
    # (donor, the donor's transfer number) of the transfer being collected.
    key: tuple[MemberId, int] | None = None
    chunks: list[bytes] = field(default_factory=list)

    def on_chunk(self, sender: MemberId, chunk: StateChunk) -> bytes | None:
        """Take one ``StateChunk`` multicast by ``sender``; the whole snapshot
        once the final chunk of the transfer being collected arrived, else
        None.  Chunks addressed to another member, and chunks of another
        transfer than the one an index-0 chunk started, are ignored."""
        if (chunk.target_node, chunk.target_pid) != (self.me.node, self.me.pid):
            return None
        key = (sender, chunk.transfer)
        if chunk.index == 0:
            self.key = key
            self.chunks = []
        if self.key != key:
            return None
        self.chunks.append(bytes(chunk.data))
        if not chunk.final:
            return None
        blob = b"".join(self.chunks)
        self.reset()
        return blob

    def reset(self) -> None:
        """Forget the transfer being collected (a rejoin waits for a new one)."""
        self.key = None
        self.chunks = []
