"""The in-memory bus of the fast tests (tests/support/membus.py): its quorum
views, and site members joining it under ``autojump_clock``.

The ``BusMember`` contract itself is checked by test_contract.py, which runs
on this bus as on the others.
"""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from cluster import state as st
from cluster.bus import BusConfig, ViewChange
from protocol import cluster as pc
from protocol.errors import BusError
from protocol.modes import Role
from tests.support.membus import MemoryBus, MemorySite, open_memory_member


async def next_view(events: object) -> ViewChange:
    event = await anext(events)  # type: ignore[call-overload]
    assert isinstance(event, ViewChange), event
    return event


async def test_quorate_follows_the_expected_size_and_set_quorate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = MemoryBus(expected_members=3)
    async with hub.join(1) as a:
        events = a.events()
        assert (await next_view(events)).quorate is False  # 1 of 3
        async with hub.join(2) as b:
            view = await next_view(events)
            assert (view.members, view.joined, view.quorate) == ((a.me, b.me), (b.me,), True)
            hub.set_quorate(False)  # a minority partition: same members, no quorum
            view = await next_view(events)
            assert (view.members, view.joined, view.left, view.quorate) == (
                (a.me, b.me),
                (),
                (),
                False,
            )
            hub.set_quorate(None)
            assert (await next_view(events)).quorate is True
        view = await next_view(events)
        assert (view.left, view.quorate) == ((b.me,), False)


async def test_a_killed_member_ends_with_bus_error_and_the_others_see_it_leave(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = MemoryBus()
    async with hub.join(1) as a, hub.join(2) as b:
        a_events, b_events = a.events(), b.events()
        assert (await next_view(a_events)).members == (a.me,)
        assert (await next_view(a_events)).joined == (b.me,)
        await next_view(b_events)
        await b.multicast(b"last words")
        hub.kill(b.me)
        with pytest.raises(BusError, match="killed"):
            await anext(b_events)  # a lost connection: the unread delivery is gone too
        with pytest.raises(BusError, match="killed"):
            await b.multicast(b"too late")
        assert (await anext(a_events)).payload == b"last words"  # type: ignore[union-attr]
        assert (await next_view(a_events)).left == (b.me,)


async def test_open_memory_member_refuses_another_group() -> None:
    opener = open_memory_member(MemoryBus(group="site-p"))
    with pytest.raises(BusError, match="site-d"):
        async with opener(BusConfig("memory", "site-d", 1), role=Role.ADMIN):
            pass


async def test_three_site_members_join_and_apply_one_stream(
    memory_site: MemorySite, autojump_clock: trio.testing.MockClock
) -> None:
    started = time.monotonic()
    a, b, c = await memory_site.join(3)
    took = time.monotonic() - started
    assert took < 5, f"a 3-member join took {took:.2f} s of wall time"
    await c.submit_and_wait(pc.QueueDeclare("orders"))
    await a.submit_and_wait(pc.Publish("", "orders", b"one", "m-1"))
    await b.submit_and_wait(pc.QueueDeclare("audit"))
    await trio.testing.wait_all_tasks_blocked()  # a's and c's appliers caught up
    for member in (a, b, c):
        assert member.membership is not None
        assert member.membership.ready == {a.me, b.me, c.me}
    assert {st.digest(m.state) for m in (a, b, c)} == {st.digest(a.state)}
    assert [q.name for q in st.list_queues(c.state)] == ["orders", "audit"]
    assert st.messages(c.state, "orders")[0].body == b"one"


async def test_a_new_member_gets_the_state_after_the_donor_left(
    memory_site: MemorySite, autojump_clock: trio.testing.MockClock
) -> None:
    a, b = await memory_site.join(2)
    await a.submit_and_wait(pc.QueueDeclare("orders"))
    memory_site.stop(a)  # the lowest member, the donor, goes
    (c,) = await memory_site.join()
    await trio.testing.wait_all_tasks_blocked()
    assert c.membership is not None and a.me not in c.membership.members
    assert st.digest(c.state) == st.digest(b.state)
    assert [q.name for q in st.list_queues(c.state)] == ["orders"]
