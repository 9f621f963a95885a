"""``drgate recover``: a whole-site recovery that waits for a broker gone for
good, shown and forced from those that reported (gateway/commands/recover.py),
on the in-memory bus with SiteMembers as the brokers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from cluster import state as st
from cluster.bus import BusConfig
from cluster.member import NullObserver, SiteMember
from cluster.state.model import Recovery
from gateway.commands.recover import _wait_live, load_site_bus, recover_site
from protocol import cluster as pc
from protocol.errors import DrgateError
from protocol.modes import Role
from tests.support.membus import MemoryBus, open_memory_member

SITE = "site-p"
EXPECT = 3
INCARNATION = 0x77


def bus(node: int, expect: int = EXPECT) -> BusConfig:
    return BusConfig("memory", SITE, node, expect_brokers=expect)


def journaled(queues: int) -> st.SiteState:
    """A state as a broker's journal recovered it: genesis and ``queues`` declares."""
    state = st.new_state()
    st.apply(state, pc.Genesis(SITE, INCARNATION))
    for i in range(queues):
        st.apply(state, pc.QueueDeclare(f"q{i}", {"durable": True}))
    return state


@asynccontextmanager
async def brokers(hub: MemoryBus, held: dict[int, int]) -> AsyncIterator[list[SiteMember]]:
    """Brokers started on their journals (``node: queues`` declared), one
    after the other; yields once every one is ready (waiting, if the site is)."""
    members = []
    async with trio.open_nursery() as nursery:
        for node, queues in held.items():
            member = SiteMember(
                SITE,
                bus(node),
                role=Role.BROKER,
                observer=NullObserver(),
                open_member=open_memory_member(hub),
            )
            member.recovered = journaled(queues)
            nursery.start_soon(member.serve)
            await member.ready.wait()
            members.append(member)
        yield members
        nursery.cancel_scope.cancel()


async def recover(hub: MemoryBus, *, force: bool, expect: int = EXPECT) -> tuple[dict, list[str]]:
    lines: list[str] = []
    with trio.fail_after(120):
        result = await recover_site(
            SITE,
            bus(9, expect),
            force=force,
            say=lines.append,
            open_member=open_memory_member(hub),
        )
    return result, lines


async def test_a_site_waiting_for_a_broker_gone_for_good_is_shown_then_forced(
    autojump_clock: trio.abc.Clock,
) -> None:
    hub = MemoryBus()
    async with brokers(hub, {2: 5, 3: 3}) as (two, three):
        assert two.recovering and three.recovering  # node 1 never comes back
        shown, lines = await recover(hub, force=False)
        assert "site site-p waits for its brokers' journals: 2 of 3 brokers reported" in lines[0]
        assert "(node 2 cseq 6, node 3 cseq 4)" in lines[0]
        assert "--force" in lines[1]
        assert [r["cseq"] for r in shown["reported"]] == [6, 4]
        assert two.recovering  # showing changed nothing

        forced, lines = await recover(hub, force=True)
        said = "\n".join(lines)
        assert forced["live"] and forced["cseq"] >= 6
        assert "continues from node 2's journal (cseq 6)" in said
        # Node 1 may have had more on disk, which D may hold: a new incarnation,
        # the chosen broker's proposal, so D resyncs rather than skip reused cseqs.
        assert forced["incarnation"] not in (0, INCARNATION)
        assert f"drgate resync --accept-incarnation {forced['incarnation']}" in said
        for member in (two, three):
            with trio.fail_after(10):
                await member.site_live.wait()
            assert member.state.incarnation == forced["incarnation"]
            assert set(member.state.queues) == {f"q{i}" for i in range(5)}  # node 2's, whole

        with pytest.raises(DrgateError, match=r"site site-p is live .* nothing to force"):
            await recover(hub, force=True)


async def test_forcing_with_no_broker_reported_is_refused(autojump_clock: trio.abc.Clock) -> None:
    hub = MemoryBus()
    with pytest.raises(DrgateError, match="no broker of site site-p reported"):
        await recover(hub, force=True)


async def test_a_site_without_journals_has_nothing_to_recover(
    autojump_clock: trio.abc.Clock,
) -> None:
    with pytest.raises(DrgateError, match="keeps no journals"):
        await recover(MemoryBus(), force=True, expect=0)


def test_the_config_may_be_a_brokers_or_a_sidecars(tmp_path: Path) -> None:
    broker = tmp_path / "broker.yaml"
    broker.write_text(
        "cluster: site-p\nnode: 2\nbus:\n  backend: corosync\n  group: g\n  expect_brokers: 3\n"
        f"journal:\n  directory: {tmp_path / 'j'}\n"
    )
    site, config = load_site_bus(str(broker))
    assert (site, config.node, config.expect_brokers) == ("site-p", 2, 3)
    nonsense = tmp_path / "x.yaml"
    nonsense.write_text("colour: blue\n")
    with pytest.raises(DrgateError, match="neither a broker's nor a sidecar's config"):
        load_site_bus(str(nonsense))


async def test_the_accept_incarnation_hint_survives_a_recovery_applied_before_the_command_looks(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The chosen broker's state may replace the command's before it looks
    again (no recovery winner left in it): the new incarnation is still told."""

    class Recovered:
        state = journaled(1)
        site_live = trio.Event()

    Recovered.state.incarnation = INCARNATION + 1  # the forced recovery's new one
    Recovered.site_live.set()
    said: list[str] = []
    await _wait_live(Recovered(), SITE, {}, said.append, 1.0, {INCARNATION}, {})  # type: ignore[arg-type]
    assert any("--accept-incarnation" in line for line in said), said
    said.clear()
    await _wait_live(Recovered(), SITE, {}, said.append, 1.0, {INCARNATION + 1}, {})  # type: ignore[arg-type]
    assert not any("--accept-incarnation" in line for line in said), said


async def test_a_forced_recovery_already_taken_when_the_command_returns_still_names_it() -> None:
    # CI, once: the recovered state had replaced the admin member's (no
    # winner any more, the site live) by the time ForceRecovery came back,
    # and the "continues from node 2's journal" line was missing.
    state = journaled(5)
    state.recoveries.append(Recovery(count=1, cseq=6, dropped=False))
    live = trio.Event()
    live.set()
    member = SimpleNamespace(state=state, site_live=live)
    candidates = {2: (20, 6, INCARNATION, 0), 3: (30, 4, INCARNATION, 0)}
    lines: list[str] = []
    result = await _wait_live(
        member,  # type: ignore[arg-type]
        SITE,
        {},
        lines.append,
        1.0,
        {INCARNATION},
        candidates,
    )
    assert lines[0] == "forced: site site-p continues from node 2's journal (cseq 6)"
    assert result["live"]
