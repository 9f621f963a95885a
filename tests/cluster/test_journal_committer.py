"""A node's journal at work (cluster/durability.py): when the committer
commits, when a publish is settled, when the node reports ``Durable``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cluster import durability
from cluster import state as st
from cluster.durability import LAZY_COMMIT_S, JournalSettings, NodeJournal
from protocol import cluster as pc

NODE = 1


class FakeMember:
    """What NodeJournal uses of a SiteMember: its state and post()."""

    def __init__(self) -> None:
        self.state = st.new_state()
        self.state.incarnation = 7
        self.posted: list[pc.Command] = []
        self.recovered: Any = None

    def post(self, cmd: pc.Command) -> None:
        self.posted.append(cmd)


class Node:
    """A NodeJournal fed frames as the applier feeds it; commits run on the
    trio thread (no worker thread) so that the clock alone orders events."""

    def __init__(self, directory: Path) -> None:
        self.member = FakeMember()
        self.nj = NodeJournal(JournalSettings(str(directory)), self.member, NODE)  # type: ignore[arg-type]
        self.commits: list[float] = []
        commit = self.nj.journal.commit

        def timed_commit() -> int:
            self.commits.append(trio.current_time())
            return commit()

        self.nj.journal.commit = timed_commit  # type: ignore[method-assign]
        self.frame([pc.SessionOpen(1 << 40)])  # the site is live: the journal starts

    def frame(self, commands: list[pc.Command], settle: Callable[[], None] | None = None) -> None:
        for cmd in commands:
            self.member.state.cseq += 1
            self.nj.after_command(cmd)
            if settle is not None and isinstance(cmd, pc.Publish):
                self.nj.settle_when_durable(settle)
        self.nj.after_frame()


def publish(n: int) -> pc.Publish:
    return pc.Publish("", "orders", b"x" * 10, f"m-{n}")


@pytest.fixture
def inline_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run_sync(fn: Callable[[], Any]) -> Any:
        return fn()

    monkeypatch.setattr(durability.trio.to_thread, "run_sync", run_sync)


async def run_node(tmp_path: Path, nursery: trio.Nursery) -> Node:
    node = Node(tmp_path / "journal")
    nursery.start_soon(node.nj.run)
    await trio.testing.wait_all_tasks_blocked()
    return node


@pytest.mark.usefixtures("inline_threads")
async def test_frames_nobody_here_settles_gather_for_the_lazy_interval(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        node = await run_node(tmp_path, nursery)
        start = trio.current_time()
        node.frame([publish(1)])
        await trio.sleep(LAZY_COMMIT_S / 2)
        node.frame([publish(2)])
        assert node.commits == []
        await trio.sleep(LAZY_COMMIT_S)
        assert node.commits == [pytest.approx(start + LAZY_COMMIT_S)]  # one commit for both
        assert node.nj.journal.durable_cseq == node.member.state.cseq
        nursery.cancel_scope.cancel()
    node.nj.close()


@pytest.mark.usefixtures("inline_threads")
async def test_a_publish_to_settle_is_committed_at_once_and_settled_after_the_commit(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    settled: list[int] = []
    async with trio.open_nursery() as nursery:
        node = await run_node(tmp_path, nursery)
        node.frame([publish(1)])  # another node's: waits
        await trio.sleep(LAZY_COMMIT_S / 2)
        now = trio.current_time()
        node.frame([publish(2)], settle=lambda: settled.append(node.nj.journal.durable_cseq))
        assert settled == []
        await trio.testing.wait_all_tasks_blocked()
        assert node.commits == [now]  # the wait ended: one commit covers both
        assert settled == [node.member.state.cseq]  # settled once on disk
        nursery.cancel_scope.cancel()
    node.nj.close()


@pytest.mark.usefixtures("inline_threads")
async def test_no_durable_report_the_sites_watermark_already_covers(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        node = await run_node(tmp_path, nursery)
        node.frame([publish(1)], settle=lambda: None)
        await trio.testing.wait_all_tasks_blocked()
        first = node.member.state.cseq
        assert node.member.posted == [pc.Durable(NODE, first)]
        # Another node reported further before this one's next commit.
        node.frame([pc.Durable(2, first + 2), publish(2)], settle=lambda: None)
        node.member.state.durable_cseq = first + 2
        await trio.testing.wait_all_tasks_blocked()
        assert node.member.posted == [pc.Durable(NODE, first)]
        node.frame([publish(3)], settle=lambda: None)
        await trio.testing.wait_all_tasks_blocked()
        assert node.member.posted[1:] == [pc.Durable(NODE, node.member.state.cseq)]
        nursery.cancel_scope.cancel()
    node.nj.close()
