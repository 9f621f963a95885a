"""A joiner whose JoinHave comes after a lower member that joined later became
ready: nobody served it, and it waited forever without a word.

Seen end to end (three brokers spawned at once on the embedded bus): broker-3
connected first but was slow; 2.3 joined first and founded the site, 3.1
joined second, 1.2 third.  2.3 gave 1.2 its state and 1.2 announced
MemberReady; only then came 3.1's JoinHave.  The donor is the lowest ready
member (cluster/membership.py): 1.2, which joined after 3.1 and so has no
join point (no cut) for it and skips it, while 2.3, which has one, is no
longer the donor.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import trio

from cluster import state as st
from cluster.bus import BusConfig, BusEvent, MemberId, ViewChange, open_bus
from cluster.bus.contract import BusMember
from cluster.member import BusOpener, NullObserver, SiteMember
from cluster.membership import AnnounceHave, Membership, SendSnapshot, StartGenesis
from protocol.cluster import JoinHave
from protocol.modes import Role
from tests.support.embeddedbus import open_embedded_site

F, X, Y = MemberId(2, 3), MemberId(3, 1), MemberId(1, 2)  # founder, slow joiner, late joiner
EMPTY = {m: JoinHave(m.node, m.pid, 0, 0, b"") for m in (F, X, Y)}


def view(n: int, members: tuple[MemberId, ...], joined: tuple[MemberId, ...]) -> ViewChange:
    return ViewChange(n, tuple(sorted(members)), joined, (), True)


def test_a_joiner_that_announces_after_a_later_lower_joiner_became_ready_is_served() -> None:
    f, y = Membership(F), Membership(Y)
    assert f.on_view(view(1, (F,), (F,))) == [StartGenesis(announce=True)]
    f.on_delivery()  # F's Genesis and MemberReady
    f.on_member_ready(F)
    assert f.on_view(view(2, (F, X), (X,))) == []  # X joins, busy elsewhere: no JoinHave yet
    v3 = view(3, (F, X, Y), (Y,))
    assert f.on_view(v3) == []
    assert y.on_view(v3) == [AnnounceHave()]
    for m in (f, y):
        m.on_delivery()  # Y's JoinHave
    assert y.on_join_have(Y, EMPTY[Y]) == []
    assert f.on_join_have(Y, EMPTY[Y]) == [SendSnapshot(Y, 1, EMPTY[Y])]
    y.on_delivery()  # F's StateChunk: Y restores with F's ready set as of the cut
    y.on_restored({F}, y.members)
    f.on_delivery()
    for m in (f, y):
        m.on_delivery()  # Y's MemberReady
        m.on_member_ready(Y)
    actions = []
    for m in (f, y):
        m.on_delivery()  # at last, X's JoinHave
        actions += m.on_join_have(X, EMPTY[X])
    # X's events: V2, V3, Y's JoinHave, the StateChunk, Y's MemberReady, its own JoinHave.
    assert actions == [SendSnapshot(X, 5, EMPTY[X])]


class _Gated:
    """A bus member whose multicasts wait for ``gate``: a process the machine
    starves, whose JoinHave leaves late."""

    def __init__(self, inner: BusMember, gate: trio.Event) -> None:
        self._inner = inner
        self._gate = gate
        self.me = inner.me

    async def multicast(self, payload: bytes) -> None:
        await self._gate.wait()
        await self._inner.multicast(payload)

    def events(self) -> AsyncIterator[BusEvent]:
        return self._inner.events()

    async def leave(self) -> None:
        await self._inner.leave()


def gated(gate: trio.Event) -> BusOpener:
    @contextlib.asynccontextmanager
    async def opener(config: BusConfig, *, role: Role) -> AsyncIterator[BusMember]:
        async with open_bus(config, role=role) as member:
            yield _Gated(member, gate)

    return opener


class Changes(NullObserver):
    """Wakes :meth:`until` at every view and command the member sees."""

    def __init__(self) -> None:
        self.changed = trio.Event()

    def view_seen(self, view: ViewChange) -> None:
        self._wake()

    def after_frame(self) -> None:
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self.changed.wait()


async def test_a_slow_joiner_on_the_embedded_bus_becomes_ready() -> None:
    async with open_embedded_site() as site:
        nursery = site.nursery
        changes = Changes()  # the founder's

        def member(node: int, open_member: BusOpener = open_bus) -> SiteMember:
            observer = changes if node == 2 else NullObserver()
            return SiteMember(
                "site-p",
                site.config(node=node),
                role=Role.BROKER,
                observer=observer,
                open_member=open_member,
            )

        with trio.fail_after(10):
            founder = member(2)
            await nursery.start(founder.serve)
            gate = trio.Event()
            slow = member(3, open_member=gated(gate))
            nursery.start_soon(slow.serve)
            await changes.until(lambda: len(getattr(founder.membership, "members", ())) == 2)
            late = member(1)
            await nursery.start(late.serve)
            assert founder.me is not None and late.me is not None and slow.me is not None
            assert late.me < founder.me
            # late's MemberReady is applied everywhere: it is the lowest ready member now.
            await changes.until(lambda: late.me in founder.membership.ready)  # type: ignore[union-attr]
        gate.set()  # the slow joiner's JoinHave leaves at last
        with trio.move_on_after(5):
            await slow.ready.wait()
        assert slow.ready.is_set(), "nobody gave the slow joiner the site state"
        assert founder.transfers.donations + late.transfers.donations == 2
        with trio.fail_after(10):
            for m in (slow, founder, slow):  # every frame sent so far applied by both
                await m.submit_and_wait()
        assert st.digest(slow.state) == st.digest(founder.state)
