"""gateway/recoverypoint: D's recovery point from the applied events and P's
heartbeats, the same at every D member; the ingress puts the heartbeats on
D's bus."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from cluster import state as st
from gateway.ingress import Ingress
from gateway.recoverypoint import HEARTBEAT_POST_INTERVAL_S, HeartbeatPoster, recovery_point
from gateway.roles import SidecarRole
from gateway.statistics import dr_section
from protocol import cluster as pc
from protocol import link
from tests.gateway.test_ingress import INCARNATION, connected, hello
from tests.support.linkpeer import MemberStandIn, replicated, sidecar_config
from tests.support.state import Member

T0 = 1_700_000_000_000_000  # P's commit time of the event D applied, µs


def d_state(applied: int = 7) -> st.SiteState:
    state = st.new_state()
    st.apply(state, pc.Genesis("site-d", 9), sender=Member(1, 1))
    st.apply(
        state, pc.Replicated("site-p", INCARNATION, applied, 1, T0, (), ()), sender=Member(1, 1)
    )
    return state


def heartbeat(state: st.SiteState, last_seq: int, time_us: int, inc: int = INCARNATION) -> None:
    st.apply(state, pc.AckWatermark("site-p", inc, last_seq, time_us), sender=Member(1, 1))


def test_nothing_of_p_no_figure() -> None:
    assert recovery_point(st.new_state(), "site-p", T0) == (None, None)


def test_without_heartbeats_the_last_applied_event_sets_the_point() -> None:
    assert recovery_point(d_state(), "site-p", T0 + 10_000_000) == (10.0, None)


def test_a_heartbeat_d_has_everything_of_keeps_an_idle_p_current() -> None:
    state = d_state(applied=7)
    heartbeat(state, 7, T0 + 8_000_000)
    assert recovery_point(state, "site-p", T0 + 10_000_000) == (2.0, 0)
    # idle P: the heartbeats' time moves on at the same seq
    heartbeat(state, 7, T0 + 9_500_000)
    assert recovery_point(state, "site-p", T0 + 10_000_000) == (0.5, 0)


def test_a_heartbeat_ahead_of_d_leaves_the_point_at_the_last_applied_event() -> None:
    state = d_state(applied=7)
    heartbeat(state, 12, T0 + 8_000_000)
    assert recovery_point(state, "site-p", T0 + 10_000_000) == (10.0, 5)


def test_a_heartbeat_of_another_incarnation_is_not_used() -> None:
    state = d_state(applied=7)
    heartbeat(state, 7, T0 + 8_000_000, inc=INCARNATION + 1)
    assert recovery_point(state, "site-p", T0 + 10_000_000) == (10.0, None)


def test_a_promoted_d_reports_no_recovery_point() -> None:
    state = d_state()
    st.apply(state, pc.Promote("site-p", 2, T0), sender=Member(1, 1))
    assert recovery_point(state, "site-p", T0 + 10_000_000) == (None, None)
    section = dr_section(state, peer_cluster="site-p", now_us=T0 + 10_000_000)
    assert (section.rpo_seconds, section.rpo_events) == (None, None)


def test_heartbeats_go_to_the_bus_at_most_once_a_second() -> None:
    posted: list[pc.Command] = []
    poster = HeartbeatPoster(posted.append)
    hello_ = link.Hello("site-p", "site-d", INCARNATION, 1, 0, 1 << 20)
    for i in range(10):
        poster.heard(hello_, link.Heartbeat(T0 + i, 7), 100.0 + i * HEARTBEAT_POST_INTERVAL_S / 4)
    assert [c.time_us for c in posted if isinstance(c, pc.AckWatermark)] == [T0, T0 + 4, T0 + 8]


async def test_the_ingress_puts_ps_heartbeats_on_ds_bus(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    member = MemberStandIn("site-d")
    config = sidecar_config(tmp_path, primary=False, site="site-d", peer="site-p")
    ingress = Ingress(config, member, role=lambda: SidecarRole.INGRESS, active=lambda: None)  # type: ignore[arg-type]
    async with connected(ingress) as end:
        await hello(end)
        end.machine.send_event(link.LinkEvent(1, T0, replicated(1)))
        assert (await end.next_of(link.Acked)).seq == 1
        end.machine.announce(time_us=T0 + 30_000_000, last_seq=1)
        await end.pump_for(6)  # one ping interval
    (mark,) = [c for c in member.posted if isinstance(c, pc.AckWatermark)]
    assert mark == pc.AckWatermark("site-p", INCARNATION, 1, T0 + 30_000_000)
    member.apply(mark)
    section = dr_section(member.state, peer_cluster="site-p", now_us=T0 + 31_000_000)
    assert (section.rpo_seconds, section.rpo_events) == (1.0, 0)
