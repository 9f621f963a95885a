"""``drgate switchover --abort`` as an operator runs it, against a P site
whose failback waits for a DR site that never comes back: it ends the wait,
so the queues give consumers messages again; with nothing to abort it says
so and changes nothing (docs/operations.md, "When the primary comes back").

The sequencer and a broker-role member of site P run in this process
(tests/support/embeddedbus.py); the command runs in a worker thread.
"""

from __future__ import annotations

import pytest
import trio

from cluster.member import SiteMember
from gateway.cli import main
from protocol import cluster as pc
from protocol.modes import Role
from tests.gateway.test_promote_auth import DEADLINE_S, Applied, sidecar_config
from tests.support.embeddedbus import open_embedded_site


async def test_abort_ends_a_failback_wait_and_refuses_when_there_is_nothing_to_abort(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with open_embedded_site("site-p") as site:
        applied = Applied()
        broker = SiteMember("site-p", site.bus, role=Role.BROKER, observer=applied)
        with trio.fail_after(DEADLINE_S):
            await site.nursery.start(broker.serve)
            # D was promoted over P (a failover), then P failed back (SetEpoch):
            # its replicated queue gives consumers nothing until D holds P.
            await broker.submit_and_wait(
                pc.QueueDeclare("q-enq"),
                pc.Superseded("site-d", 1_700_000_000_000_000, {"q-enq": pc.FAILBACK_ONLY}),
                pc.SetEpoch(3),
            )
        assert broker.state.failback_cseq > 0
        assert site.bus.key_file is not None
        config = str(sidecar_config(site.folder, site.bus, site.bus.key_file, primary=True))
        argv = ["switchover", "--abort", "--config", config]

        with trio.fail_after(DEADLINE_S):
            code = await trio.to_thread.run_sync(main, argv)
        out = capsys.readouterr().out
        assert code == 0, out
        assert "no longer waits for site-d: the queues give consumers messages again" in out
        with trio.fail_after(DEADLINE_S):
            while broker.state.failback_cseq:
                await applied.changed.wait()
        assert broker.state.failback_queues == {}

        with trio.fail_after(DEADLINE_S):
            code = await trio.to_thread.run_sync(main, argv)
        assert code == 1
        err = capsys.readouterr().err
        assert "no switchover of site-p to abort" in err and "Traceback" not in err
