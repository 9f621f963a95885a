"""gateway/roles: the one active-sidecar choice, and each sidecar's role."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio
import trio.testing

from cluster import state as st
from cluster.bus import MemberId
from gateway.roles import RoleSignal, SidecarRole, active_sidecar, role_of
from protocol import cluster as pc
from protocol.modes import Role


@dataclass
class View:
    """What role_of reads of a Membership."""

    members: frozenset[MemberId]
    quorate: bool = True
    is_ready: bool = True


def site(*ready: tuple[MemberId, Role]) -> st.SiteState:
    state = st.new_state()
    st.apply(state, pc.Genesis("site-p", 1))
    for member, role in ready:
        st.apply(state, pc.MemberReady(role, member.node, member.pid))
    return state


A, B, C = MemberId(1, 100), MemberId(2, 50), MemberId(3, 10)
BROKER = MemberId(0, 1)


def test_the_sidecar_ready_longest_in_the_view_is_active() -> None:
    state = site((A, Role.SIDECAR), (B, Role.SIDECAR), (BROKER, Role.BROKER))
    view = View(frozenset({A, B, BROKER}))
    assert active_sidecar(state, view) == A  # type: ignore[arg-type]
    # A left the view: B takes over, with no message exchanged.
    assert active_sidecar(state, View(frozenset({B, BROKER}))) == B  # type: ignore[arg-type]
    # A sidecar that is in the view but not ready yet is not chosen.
    assert active_sidecar(state, View(frozenset({C, BROKER}))) is None  # type: ignore[arg-type]


def test_a_sidecar_that_restarts_does_not_take_over_again() -> None:
    # tests/chaos, seed 77: node 1's sidecar restarted (a new pid, an empty
    # spool from its join on) and took the link back at once; D was behind
    # its spool, so the link resynced, and the enqueue queue's messages P's
    # consumers took in between never reached D.
    a_again = MemberId(1, 200)
    state = site((A, Role.SIDECAR), (B, Role.SIDECAR))
    st.members_left(state, [A])
    st.apply(state, pc.MemberReady(Role.SIDECAR, a_again.node, a_again.pid))
    view = View(frozenset({a_again, B}))
    assert active_sidecar(state, view) == B  # type: ignore[arg-type]
    # Through a state transfer too: the order is part of the state.
    restored = st.restore_untrusted(st.snapshot(state))
    assert active_sidecar(restored, view) == B  # type: ignore[arg-type]


def test_a_sidecar_that_announces_itself_again_goes_to_the_back() -> None:
    # A sidecar whose spool failed a write steps back this way (tests/chaos,
    # seed 510118558: the egress's spool disk filled, the link resynced, and
    # the enqueue queue lost what P's consumers took meanwhile).
    state = site((A, Role.SIDECAR), (B, Role.SIDECAR), (C, Role.SIDECAR))
    st.apply(state, pc.MemberReady(Role.SIDECAR, A.node, A.pid))
    view = View(frozenset({A, B, C}))
    assert active_sidecar(state, view) == B  # type: ignore[arg-type]
    assert list(state.ready) == [(B.node, B.pid), (C.node, C.pid), (A.node, A.pid)]
    restored = st.restore_untrusted(st.snapshot(state))
    assert list(restored.ready) == list(state.ready)


@pytest.mark.parametrize(
    ("me", "primary", "expected"),
    [
        (A, True, SidecarRole.EGRESS),
        (B, True, SidecarRole.STANDBY),
        (A, False, SidecarRole.INGRESS),
        (B, False, SidecarRole.INGRESS_STANDBY),
    ],
)
def test_role_by_site_and_rank(me: MemberId, primary: bool, expected: SidecarRole) -> None:
    state = site((A, Role.SIDECAR), (B, Role.SIDECAR))
    view = View(frozenset({A, B}))
    assert role_of(me, state, view, ready=True, primary=primary) == expected  # type: ignore[arg-type]


def test_a_minority_or_a_joining_sidecar_does_nothing() -> None:
    state = site((A, Role.SIDECAR))
    minority = View(frozenset({A}), quorate=False)
    assert role_of(A, state, minority, ready=True, primary=True) == SidecarRole.MINORITY  # type: ignore[arg-type]
    view = View(frozenset({A}))
    assert role_of(A, state, view, ready=False, primary=True) == SidecarRole.STARTING  # type: ignore[arg-type]
    assert role_of(A, state, None, ready=True, primary=True) == SidecarRole.STARTING
    assert str(SidecarRole.INGRESS_STANDBY) == "ingress-standby"  # the name metrics show


def test_a_sidecar_of_a_site_waiting_for_its_recovery_does_nothing() -> None:
    # A site that started over (cluster/membership.py) is ready with the empty
    # state until its brokers' recovery: an ingress must not take P's events
    # into a state the recovery replaces, nor an egress dial from it.
    state = st.new_state()
    st.apply(state, pc.MemberReady(Role.SIDECAR, A.node, A.pid))
    view = View(frozenset({A}))
    assert role_of(A, state, view, ready=True, primary=False) == SidecarRole.STARTING  # type: ignore[arg-type]
    assert role_of(A, state, view, ready=True, primary=True) == SidecarRole.STARTING  # type: ignore[arg-type]


async def test_role_signal_wakes_every_waiter(autojump_clock: trio.testing.MockClock) -> None:
    signal = RoleSignal()
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await signal.wait()
        woken.append(n)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, 1)
        nursery.start_soon(waiter, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert woken == []
        signal.changed()
    assert sorted(woken) == [1, 2]
