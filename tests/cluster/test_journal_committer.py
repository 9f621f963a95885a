"""A node's journal at work (cluster/durability.py): when the committer
commits, when a publish is settled, when the node reports ``Durable``."""

from __future__ import annotations

import errno
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cluster import durability
from cluster import journal as journal_module
from cluster import state as st
from cluster.durability import LAZY_COMMIT_S, CommitThread, JournalSettings, NodeJournal
from cluster.journal import Journal, JournalError
from protocol import cluster as pc

NODE = 1


class FakeMember:
    """What NodeJournal uses of a SiteMember: its state and post()."""

    def __init__(self) -> None:
        self.state = st.new_state()
        self.state.incarnation = 7
        self.posted: list[pc.Command] = []
        self.recovered: Any = None
        self.delivered_frame = b""

    def post(self, cmd: pc.Command) -> None:
        self.posted.append(cmd)


class Node:
    """A NodeJournal fed frames as the applier feeds it; with the
    ``inline_commits`` fixture commits run on the trio thread (no committer
    thread) so that the clock alone orders events."""

    def __init__(self, directory: Path) -> None:
        self.member = FakeMember()
        self.nj = NodeJournal(JournalSettings(str(directory)), self.member, NODE)  # type: ignore[arg-type]
        self.commits: list[float] = []
        self.threads: list[int] = []
        commit = self.nj.journal.commit

        def timed_commit() -> int:
            self.threads.append(threading.get_ident())
            try:
                self.commits.append(trio.current_time())
            except RuntimeError:  # in the committer thread: no trio clock there
                self.commits.append(math.nan)
            return commit()

        self.nj.journal.commit = timed_commit  # type: ignore[method-assign]
        self.frame([pc.SessionOpen(1 << 40)])  # the site is live: the journal starts

    def frame(self, commands: list[pc.Command], settle: Callable[[], None] | None = None) -> None:
        self.member.delivered_frame = pc.encode_frame(commands)
        for cmd in commands:
            self.member.state.cseq += 1
            self.nj.after_command(cmd)
            if settle is not None and isinstance(cmd, pc.Publish):
                self.nj.settle_when_durable(settle)
        self.nj.after_frame()


def publish(n: int) -> pc.Publish:
    return pc.Publish("", "orders", b"x" * 10, f"m-{n}")


class InlineCommits:
    """A CommitThread that commits on the caller's thread when asked."""

    def __init__(self, journal: Journal, committed: durability.Committed) -> None:
        self.journal = journal
        self.committed = committed

    def start(self) -> None:
        pass

    def ask(self) -> None:
        self.committed(self.journal.commit(), None)

    def stop(self) -> None:
        pass

    def join(self, timeout: float) -> None:
        pass


@pytest.fixture
def inline_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(durability, "CommitThread", InlineCommits)


async def run_node(tmp_path: Path, nursery: trio.Nursery) -> Node:
    node = Node(tmp_path / "journal")
    nursery.start_soon(node.nj.run)
    await trio.testing.wait_all_tasks_blocked()
    return node


@pytest.mark.usefixtures("inline_commits")
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


@pytest.mark.usefixtures("inline_commits")
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


@pytest.mark.usefixtures("inline_commits")
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


async def test_the_committer_thread_commits_off_the_trio_thread_then_settles(
    tmp_path: Path,
) -> None:
    settled = trio.Event()
    async with trio.open_nursery() as nursery:
        node = await run_node(tmp_path, nursery)
        node.frame([publish(1)], settle=settled.set)
        with trio.fail_after(10):
            await settled.wait()
        assert node.nj.journal.durable_cseq == node.member.state.cseq
        assert node.threads and threading.get_ident() not in node.threads
        assert node.member.posted == [pc.Durable(NODE, node.member.state.cseq)]
        nursery.cancel_scope.cancel()
    node.nj.close()


class GatedJournal:
    """A journal whose first commit waits until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.commits = 0

    def commit(self) -> int:
        self.commits += 1
        if self.commits == 1:
            self.entered.set()
            assert self.gate.wait(10)
        return self.commits


async def test_asks_during_a_commit_make_one_more_commit_right_after_it() -> None:
    journal = GatedJournal()
    results: list[tuple[int, BaseException | None]] = []
    both = trio.Event()

    def committed(durable: int, error: BaseException | None) -> None:
        results.append((durable, error))
        if len(results) == 2:
            both.set()

    committer = CommitThread(journal, committed)  # type: ignore[arg-type]
    committer.start()
    committer.ask()
    assert await trio.to_thread.run_sync(journal.entered.wait, 10)
    committer.ask()
    committer.ask()
    journal.gate.set()
    with trio.fail_after(10):
        await both.wait()
    committer.stop()
    await trio.to_thread.run_sync(committer.join, 10)
    assert results == [(1, None), (2, None)]
    assert journal.commits == 2


async def test_a_failed_commit_in_the_thread_raises_from_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = Node(tmp_path / "journal")
    settled: list[int] = []

    def no_space(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal_module, "_write_all", no_space)
    node.frame([publish(1)], settle=lambda: settled.append(1))  # asks: the thread commits
    with pytest.raises(JournalError, match="No space left"), trio.fail_after(10):
        await node.nj.run()
    assert settled == []
    node.nj.close()
