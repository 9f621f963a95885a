"""gateway/sidecar: whole sidecars on an in-memory site bus under a virtual
clock: role choice, takeover when the egress is lost, a minority stands down."""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cluster import state as st
from cluster.addresses import Address
from cluster.bus import BusConfig
from cluster.member import NullObserver, SiteMember
from gateway.roles import SidecarRole
from gateway.sidecar import Sidecar
from gateway.spool import Spool
from protocol import cluster as pc
from protocol.errors import BusError
from protocol.modes import Role
from tests.support.linkpeer import sidecar_config
from tests.support.membus import MemoryBus, open_memory_member
from tests.support.state import genesis_state

WITHIN_S = 30.0  # virtual seconds


async def wait_until(condition: Callable[[], bool], *sidecars: Sidecar) -> None:
    """Until ``condition()`` holds, checked at every role change of ``sidecars``."""
    with trio.fail_after(WITHIN_S):
        while True:
            changes = [sidecar.roles.next_change for sidecar in sidecars]
            if condition():
                return
            async with trio.open_nursery() as nursery:
                for change in changes:
                    nursery.start_soon(_cancel_after, change, nursery.cancel_scope)


async def _cancel_after(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


class PrimarySite:
    """P's sidecars on one memory bus; ``dialled`` lists (node, D address) of
    every connection an egress tries (each fails after a second)."""

    def __init__(self, tmp_path: Path, nursery: trio.Nursery) -> None:
        self.tmp_path = tmp_path
        self.nursery = nursery
        self.hub = MemoryBus(group="site-p", expected_members=3)
        self.dialled: list[tuple[int, str]] = []
        self.dialling = trio.Event()

    async def wait_dialled(self, node: int) -> None:
        """Until sidecar ``node`` has dialled D."""
        with trio.fail_after(WITHIN_S):
            while not any(n == node for n, _ in self.dialled):
                await self.dialling.wait()
                self.dialling = trio.Event()

    async def start(self, node: int) -> Sidecar:
        config = sidecar_config(
            self.tmp_path, primary=True, site="site-p", peer="site-d", node=node
        )

        async def connect(address: Address) -> trio.abc.Stream:
            self.dialled.append((node, str(address)))
            self.dialling.set()
            await trio.sleep(1)
            raise OSError(f"{address} does not answer (test)")

        sidecar = Sidecar(config, open_member=open_memory_member(self.hub), connect=connect)
        await self.nursery.start(self._serve, sidecar)
        return sidecar

    async def start_three(self) -> tuple[Sidecar, Sidecar, Sidecar]:
        """Sidecars 1, 2 and 3, once the last is a standby (1 is the egress)."""
        first, second, third = [await self.start(node) for node in (1, 2, 3)]
        await wait_until(lambda: third.current_role() == SidecarRole.STANDBY, third)
        return first, second, third

    @staticmethod
    async def _serve(sidecar: Sidecar, *, task_status: trio.TaskStatus[None]) -> None:
        try:
            await sidecar.serve(task_status=task_status)
        except* BusError:
            pass  # killed by the test


async def test_the_lowest_sidecar_is_the_egress_and_a_standby_takes_over(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        site = PrimarySite(tmp_path, nursery)
        first, second, third = await site.start_three()
        assert second.current_role() == SidecarRole.STANDBY
        assert first.current_role() == SidecarRole.EGRESS
        assert first.active_sidecar() == third.active_sidecar() == first.member.me
        await site.wait_dialled(1)
        assert {node for node, _ in site.dialled} == {1}  # only the egress dials D

        assert first.member.me is not None
        site.hub.kill(first.member.me)  # its process dies: no goodbye
        await wait_until(lambda: second.current_role() == SidecarRole.EGRESS, second)
        assert third.current_role() == SidecarRole.STANDBY
        await site.wait_dialled(2)
        assert {node for node, _ in site.dialled} == {1, 2}  # never the standby, node 3
        assert second.egress is not None
        assert second.egress.status.state == "connecting"
        nursery.cancel_scope.cancel()


async def test_a_sidecar_in_a_minority_neither_forwards_nor_dials(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        site = PrimarySite(tmp_path, nursery)
        egress = await site.start(1)
        await site.start(2)
        await site.wait_dialled(1)
        site.hub.set_quorate(False)
        await wait_until(lambda: egress.current_role() == SidecarRole.MINORITY, egress)
        assert egress.statistics().last_error.startswith("in a minority partition")
        await trio.sleep(WITHIN_S)  # virtual: an attempt under way ends, and no other starts
        dialled = len(site.dialled)
        await trio.sleep(WITHIN_S)
        assert len(site.dialled) == dialled
        assert egress.egress is not None
        assert egress.egress.status.state == "minority"
        site.hub.set_quorate(None)
        await wait_until(lambda: egress.current_role() == SidecarRole.EGRESS, egress)
        await site.wait_dialled(1)
        assert len(site.dialled) == dialled + 1
        nursery.cancel_scope.cancel()


async def test_a_command_the_tap_cannot_forward_makes_d_resync_not_the_sidecar_stop(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with trio.open_nursery() as nursery:
        site = PrimarySite(tmp_path, nursery)
        egress = await site.start(1)
        await site.start(2)
        await wait_until(lambda: egress.current_role() == SidecarRole.EGRESS, egress)
        tap_command = egress.tap.on_command

        def failing(state: Any, cmd: pc.Command, effects: Any, time_us: int) -> Any:
            if isinstance(cmd, pc.QueueDeclare) and cmd.queue == "q-boom":
                raise RuntimeError("a bug in the tap (test)")
            return tap_command(state, cmd, effects, time_us)

        monkeypatch.setattr(egress.tap, "on_command", failing)
        await egress.member.submit_and_wait(pc.QueueDeclare("q-full"))
        assert egress.spool is not None
        served = egress.spool.statistics().last_seq
        assert served is not None and not egress.spool.needs_resync(served)
        await egress.member.submit_and_wait(pc.QueueDeclare("q-boom"))
        failed_at = egress.state.cseq
        await egress.member.submit_and_wait(pc.QueueDeclare("q-full", {"x": 1}))

        assert egress.current_role() == SidecarRole.EGRESS  # still serving
        assert egress.tap.statistics().dropped_total["tap_failure"] == 1
        assert "cseq" in egress.statistics().last_error
        # A D that holds what was spooled before the failure cannot stream past it.
        assert egress.spool.floor >= failed_at
        assert egress.spool.needs_resync(served)
        nursery.cancel_scope.cancel()


async def test_peers_set_at_run_time_are_dialled_from_the_next_attempt(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        site = PrimarySite(tmp_path, nursery)
        egress = await site.start(1)
        await site.start(2)
        await site.wait_dialled(1)
        assert {a for _, a in site.dialled} <= {"d1:1", "d2:1"}
        assert egress.egress is not None
        egress.egress.set_peers((Address("d3", 1),))  # the config was edited
        with trio.fail_after(WITHIN_S):
            while "d3:1" not in {a for _, a in site.dialled}:
                await site.dialling.wait()
                site.dialling = trio.Event()
        nursery.cancel_scope.cancel()


def fill_disk_of(directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write to a file under ``directory`` fails as on a full disk."""
    prefix = os.path.realpath(directory)
    real_write = os.write

    def write(fd: int, data: bytes | memoryview) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(prefix):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


async def test_an_egress_whose_spool_disk_fails_steps_back_for_a_standby_that_holds_the_events(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tests/chaos, seed 510118558: the egress's spool disk filled, its floor
    # rose past what D had applied, and the link resynced; the resync of the
    # enqueue queue could not bring back what P's consumers took meanwhile
    # (218 messages lost), while the standbys' spools held every event.
    async with trio.open_nursery() as nursery:
        site = PrimarySite(tmp_path, nursery)
        first, second, third = await site.start_three()
        assert first.current_role() == SidecarRole.EGRESS
        await first.member.submit_and_wait(pc.QueueDeclare("q-full"))
        assert first.spool is not None and second.spool is not None
        applied_at_d = first.spool.statistics().last_seq
        assert applied_at_d is not None

        fill_disk_of(first.config.spool_dir, monkeypatch)
        await first.member.submit_and_wait(pc.QueueDeclare("q-full", {"x": 1}))
        assert first.spool.failing and first.spool.needs_resync(applied_at_d)

        await wait_until(lambda: second.current_role() == SidecarRole.EGRESS, first, second)
        assert first.current_role() == SidecarRole.STANDBY
        assert third.current_role() == SidecarRole.STANDBY
        assert not second.spool.needs_resync(applied_at_d)  # D resumes, no resync
        await site.wait_dialled(2)
        nursery.cancel_scope.cancel()


async def test_a_lone_egress_whose_spool_disk_fails_keeps_the_link(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with trio.open_nursery() as nursery:
        site = PrimarySite(tmp_path, nursery)
        egress = await site.start(1)
        site.hub.set_quorate(True)  # the others are down
        await wait_until(lambda: egress.current_role() == SidecarRole.EGRESS, egress)
        fill_disk_of(egress.config.spool_dir, monkeypatch)
        await egress.member.submit_and_wait(pc.QueueDeclare("q-full"))
        assert egress.spool is not None and egress.spool.failing
        assert egress.current_role() == SidecarRole.EGRESS  # no one else: D resyncs
        nursery.cancel_scope.cancel()


def journaled_sidecar(tmp_path: Path, nursery: trio.Nursery, hub: MemoryBus, node: int) -> Sidecar:
    """A sidecar of a P whose brokers journal (one broker expected), serving."""
    config = sidecar_config(tmp_path, primary=True, site="site-p", peer="site-d", node=node)
    config = dataclasses.replace(config, bus=dataclasses.replace(config.bus, expect_brokers=1))

    async def connect(address: Address) -> trio.abc.Stream:
        await trio.sleep(1)
        raise OSError(f"{address} does not answer (test)")

    sidecar = Sidecar(config, open_member=open_memory_member(hub), connect=connect)
    nursery.start_soon(
        functools.partial(PrimarySite._serve, sidecar, task_status=trio.TASK_STATUS_IGNORED)
    )
    return sidecar


async def recover_site(
    tmp_path: Path, nursery: trio.Nursery, recovered: st.SiteState, hub: MemoryBus | None = None
) -> Sidecar:
    """P restarted whole: a sidecar joins, then a broker whose journal
    recovered ``recovered``; the sidecar once the site is live again."""
    hub = hub or MemoryBus(group="site-p")
    sidecar = journaled_sidecar(tmp_path, nursery, hub, 1)
    with trio.fail_after(WITHIN_S):
        await sidecar.member.ready.wait()
    broker = SiteMember(
        "site-p",
        BusConfig("memory", "site-p", 9, expect_brokers=1),
        role=Role.BROKER,
        observer=NullObserver(),
        open_member=open_memory_member(hub),
    )
    broker.recovered = recovered
    nursery.start_soon(broker.serve)
    with trio.fail_after(WITHIN_S):
        await sidecar.member.site_live.wait()
        while sidecar.spool is None:  # noqa: ASYNC110 (serve opens it right after)
            await trio.sleep(0.1)
    return sidecar


def journal_state(*, transient: bool) -> st.SiteState:
    state = genesis_state("site-p", 7)
    st.apply(state, pc.QueueDeclare("q-full", {"durable": True}))
    st.apply(state, pc.Publish("", "q-full", b"kept", "1", {pc.DURABLE_PROPERTY: True}))
    if transient:
        st.apply(state, pc.Publish("", "q-full", b"", "2"))  # its body was not journaled
    return state


@pytest.mark.parametrize("transient", [True, False])
async def test_a_recovery_that_dropped_transient_state_resyncs_d(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, transient: bool
) -> None:
    async with trio.open_nursery() as nursery:
        sidecar = await recover_site(tmp_path, nursery, journal_state(transient=transient))
        assert sidecar.state.incarnation == 7
        assert [m.message_id for m in sidecar.state.queues["q-full"].messages.values()] == ["1"]
        assert bool(sidecar.member.recovery_dropped) == transient
        assert sidecar.egress is not None
        # D's next connection gets a resync at a cut after the recovery point,
        # whatever the spool holds below it.
        assert sidecar.egress._force_resync == transient
        nursery.cancel_scope.cancel()


async def test_a_sidecar_down_during_the_recovery_drops_the_lost_history_and_resyncs_d(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    recovered = journal_state(transient=True)
    lost = recovered.cseq + 3
    # Before the power cut, sidecar 2 spooled events up to ``lost`` that no
    # broker journaled (never settled, held back by the durable gate).
    with Spool.open(tmp_path / "spool-2", incarnation=7, start_after=0) as old:
        old.append_many((seq, 1_000, b"lost", seq - 1) for seq in range(1, lost + 1))
    async with trio.open_nursery() as nursery:
        hub = MemoryBus(group="site-p")
        first = await recover_site(tmp_path, nursery, recovered, hub)
        assert first.state.recoveries == [st.Recovery(1, recovered.cseq, True)]
        while first.state.cseq < lost:  # the new history passes what it spooled
            await first.member.submit_and_wait(pc.QueueDeclare("new", {"durable": True}))
        late = journaled_sidecar(tmp_path, nursery, hub, 2)
        with trio.fail_after(WITHIN_S):
            while late.spool is None:  # noqa: ASYNC110 (serve opens it once joined)
                await trio.sleep(0.1)
        assert late.state.recoveries == first.state.recoveries
        assert late.spool.read_after(0, 1 << 20) == []  # nothing of the lost history
        assert late.spool.written_under == 0
        assert "before whole-site recovery 1" in caplog.text
        # It missed a recovery that dropped transient state: D is resynced by
        # it too, whoever took part in the recovery.
        assert late.egress is not None and late.egress._force_resync
        nursery.cancel_scope.cancel()
