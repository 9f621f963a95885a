"""``drgate failback --delta`` refuses what it cannot do with a text that
names the fix: configs that link one way, a site that was not promoted by a
failover, the old primary's step without its ``--after`` and ``--out``.
The command runs as an operator runs it, against an embedded bus in this
process (tests/support/embeddedbus.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from cluster.member import SiteMember
from gateway.cli import main
from protocol.modes import Role
from tests.gateway.test_promote_auth import DEADLINE_S, Applied, sidecar_config
from tests.support.embeddedbus import open_embedded_site


def both_ways(path: Path) -> Path:
    """The DR config at ``path``, linking both ways (``peers`` added)."""
    path.write_text(path.read_text() + "peers: [127.0.0.1:9]\n")
    return path


async def test_a_failback_by_delta_names_what_it_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with open_embedded_site("site-d") as site:
        assert site.bus.key_file is not None
        one_way = sidecar_config(site.folder, site.bus, site.bus.key_file)
        with trio.fail_after(DEADLINE_S):
            code = await trio.to_thread.run_sync(
                main, ["failback", "--delta", "--config", str(one_way)]
            )
        assert code == 1
        err = capsys.readouterr().err
        assert "links one way only" in err and "use 'drgate failback' without --delta" in err

        broker = SiteMember("site-d", site.bus, role=Role.BROKER, observer=Applied())
        with trio.fail_after(DEADLINE_S):
            await site.nursery.start(broker.serve)
        config = str(both_ways(one_way))
        with trio.fail_after(DEADLINE_S):
            code = await trio.to_thread.run_sync(main, ["failback", "--delta", "--config", config])
        assert code == 1
        err = capsys.readouterr().err
        assert "site-d was not promoted over site-p by a failover (drgate promote)" in err
        assert not broker.state.swapped

        with trio.fail_after(DEADLINE_S):
            code = await trio.to_thread.run_sync(
                main, ["failback", "--delta", "--after", "12", "--config", config]
            )
        assert code == 1
        err = capsys.readouterr().err
        assert "needs --after CSEQ" in err and "--out DIR (where its divergent tail" in err
