"""``drgate promote`` joins D's bus like every member: a tool that does not
hold the site's bus key is refused at the bus, and the site stays
unpromoted (docs/architecture.md section 12, "Membership of a site's bus is
the authentication").

The sequencer and a broker-role member of site D run in this process
(tests/support/embeddedbus.py); the command runs as an operator runs it,
``drgate promote --config FILE``, in a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from cluster.bus import BusConfig, MemberId
from cluster.member import NullObserver, SiteMember
from cluster.state.effects import Effect
from gateway.cli import main
from lab.site import LAB_RULES
from protocol import cluster as pc
from protocol.modes import Role
from tests.support.embeddedbus import open_embedded_site

DEADLINE_S = 30


class Applied(NullObserver):
    """Wakes whoever waits at every command the member applied."""

    def __init__(self) -> None:
        self.changed = trio.Event()

    def after_command(
        self, cmd: pc.Command, effects: Sequence[Effect], sender: MemberId, own: bool
    ) -> None:
        self.changed.set()
        self.changed = trio.Event()


def sidecar_config(folder: Path, bus: BusConfig, key_file: str, *, primary: bool = False) -> Path:
    """A sidecar config on ``bus`` (a DR one of site-d, or a primary one of
    site-p), as an operator's tools take it."""
    assert bus.address is not None
    path = folder / ("sidecar-p.yaml" if primary else "sidecar-d.yaml")
    role = (
        "site: site-p\nrole: primary\nnode: 5\npeer_cluster: site-d\npeers: [127.0.0.1:9]\n"
        if primary
        else "site: site-d\nrole: dr\nnode: 5\npeer_cluster: site-p\nlisten: 127.0.0.1:0\n"
    )
    path.write_text(
        role + f"bus: {{backend: embedded, group: {bus.group}, address: '{bus.address}', "
        f"key_file: {key_file}}}\n"
        f"spool: {{directory: {folder / 'spool'}}}\nrules: {LAB_RULES}\ninsecure: true\n"
    )
    return path


async def test_a_promote_from_a_tool_without_the_site_key_is_refused_at_the_bus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with open_embedded_site("site-d") as site:
        applied = Applied()
        broker = SiteMember("site-d", site.bus, role=Role.BROKER, observer=applied)
        with trio.fail_after(DEADLINE_S):
            await site.nursery.start(broker.serve)
        views = site.server.statistics().view_id

        stranger = sidecar_config(site.folder, site.bus, site.other_key())
        with trio.fail_after(DEADLINE_S):
            code = await trio.to_thread.run_sync(main, ["promote", "--config", str(stranger)])
        assert code == 1
        err = capsys.readouterr().err
        assert err.startswith("drgate promote: the sequencer at ")
        assert "refused this member: it does not hold the site's bus key" in err
        assert "Traceback" not in err
        origin = broker.state.origins.get("site-p")
        assert origin is None or not origin.promoted
        stats = site.server.statistics()
        assert (stats.refused, stats.view_id) == (1, views)  # it never joined

        # The same command with the site's key promotes: the refusal above
        # was the key's doing, nothing else's.
        assert site.bus.key_file is not None
        member = sidecar_config(site.folder, site.bus, site.bus.key_file)
        with trio.fail_after(DEADLINE_S):
            code = await trio.to_thread.run_sync(main, ["promote", "--config", str(member)])
        assert code == 0, capsys.readouterr().err
        assert "promoted: epoch 1" in capsys.readouterr().out
        # The tool returns once it applied its own Promote; the broker
        # applies it when its bus delivers it to it.
        with trio.fail_after(DEADLINE_S):
            while (origin := broker.state.origins.get("site-p")) is None or not origin.promoted:
                await applied.changed.wait()
