"""One contract suite for every site bus backend (docs/architecture.md, section 4).

Members run as separate processes (``member_driver.py``), so that one can be
killed with SIGKILL; for the corosync backend each runs inside its node's
network namespace of a 3-node lab site (lab/netns.py).  On the
in-memory bus of the fast tests (tests/support/membus.py) the same driver
runs as a task and a kill is the hub's.  The same test code runs on every
backend; cases that need partitions are corosync only.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from cluster.bus.auth import write_key_file
from lab.netns import CorosyncSite
from tests.cluster.bus.member_driver import drive_member
from tests.lab import corosync_lab
from tests.support.membus import MemoryBus, MemoryMember

DRIVER = Path(__file__).with_name("member_driver.py")
REPO = Path(__file__).resolve().parents[3]
LAB_PREFIX = "dgT"
TIMEOUT_S = 30

BACKENDS = [
    # A real sequencer process per test: make test runs it (on both cores),
    # make check-fast has the in-memory bus for the contract's logic.
    pytest.param("embedded", marks=[pytest.mark.integration, pytest.mark.slow]),
    pytest.param(
        "corosync",
        marks=[pytest.mark.corosync, pytest.mark.integration, pytest.mark.slow],
    ),
    "memory",
]


@pytest.fixture(scope="module")
def corosync_site() -> Iterator[CorosyncSite]:
    with corosync_lab("bustest", subnet="10.213.7", prefix=LAB_PREFIX) as site:
        yield site


@dataclass
class Bus:
    backend: str
    group: str
    argv_in_node: Callable[[int, list[str]], list[str]] = lambda _node, argv: argv
    address: str | None = None
    key_file: str | None = None  # embedded: the site's bus key
    site: CorosyncSite | None = None
    hub: MemoryBus | None = None  # the memory backend: members are tasks

    def member_argv(self, node: int) -> list[str]:
        argv = [sys.executable, str(DRIVER), "--backend", self.backend]
        argv += ["--group", self.group, "--node", str(node)]
        if self.address:
            argv += ["--address", self.address]
        if self.key_file:
            argv += ["--key-file", self.key_file]
        return self.argv_in_node(node, argv)


@pytest.fixture(params=BACKENDS)
def bus(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Bus]:
    group = f"t{uuid.uuid4().hex[:12]}"
    if request.param == "corosync":
        site = request.getfixturevalue("corosync_site")
        yield Bus("corosync", group, site.ns_argv, site=site)
        return
    if request.param == "memory":
        yield Bus("memory", group, hub=MemoryBus())
        return
    key_file = str(tmp_path / "bus.key")
    write_key_file(key_file)
    sequencer = subprocess.Popen(
        [
            *[sys.executable, "-m", "gateway.cli", "bus", "--listen", "127.0.0.1:0"],
            *["--group", group, "--key-file", key_file],
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert sequencer.stdout is not None
        line = sequencer.stdout.readline()
        assert line.startswith("listening on "), line
        address = line.split()[2]
        yield Bus("embedded", group, address=address, key_file=key_file)
    finally:
        sequencer.send_signal(signal.SIGTERM)
        try:
            assert sequencer.wait(timeout=10) == 0
        finally:
            if sequencer.poll() is None:
                sequencer.kill()
                sequencer.wait()
            if sequencer.stdout is not None:
                sequencer.stdout.close()


@dataclass(eq=False)
class Member:
    """One member (a process, or a task on the memory bus) and what it reported so far."""

    node: int
    process: trio.Process | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)
    me: str = ""
    # The memory backend: the driver task, its command lines, its bus member.
    task_scope: trio.CancelScope | None = None
    lines: trio.MemorySendChannel[str] | None = None

    def report(self, record: dict[str, Any]) -> None:
        if record["t"] == "me":
            self.me = record["me"]
        self.records.append(record)
        self.changed.set()
        self.changed = trio.Event()

    async def pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        buffer = b""
        async for data in self.process.stdout:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                self.report(json.loads(line))
        self.report({"t": "exit"})

    def kill(self) -> None:
        """SIGKILL: the member ends without a goodbye or another word."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            return
        assert self.task_scope is not None
        self.task_scope.cancel()  # the task drops its member from the hub as it ends

    async def wait_for(self, condition: Callable[[Member], bool], what: str) -> None:
        try:
            with trio.fail_after(TIMEOUT_S):
                while not condition(self):
                    errors = [r for r in self.records if r["t"] in ("error", "exit")]
                    assert not errors, f"member on node {self.node} ended: {errors}"
                    await self.changed.wait()
        except trio.TooSlowError:
            tail = self.records[-5:]
            raise AssertionError(
                f"node {self.node} member {self.me}: no {what}; last {tail}"
            ) from None

    async def command(self, text: str) -> None:
        if self.lines is not None:
            await self.lines.send(text)
            return
        assert self.process is not None and self.process.stdin is not None
        await self.process.stdin.send_all(text.encode() + b"\n")

    @property
    def events(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["t"] in ("view", "msg")]

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["t"] == "msg"]

    def views(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["t"] == "view"]

    def sees_members(self, count: int) -> bool:
        views = self.views()
        return bool(views) and len(views[-1]["members"]) == count

    def stream_from_view_with(self, members: set[str]) -> list[tuple[Any, ...]]:
        """Events from the first view whose members are ``members`` (view ids dropped)."""
        events = self.events
        for i, event in enumerate(events):
            if event["t"] == "view" and set(event["members"]) == members:
                return [_comparable(e) for e in events[i:]]
        raise AssertionError(f"member {self.me} never saw a view of {sorted(members)}")

    async def stats(self) -> dict[str, Any]:
        """The member's statistics, asked for now (events may come in between)."""
        seen = len(self.records)
        await self.command("stats")

        def answers(member: Member) -> list[dict[str, Any]]:
            return [r for r in member.records[seen:] if r["t"] == "stats"]

        await self.wait_for(lambda m: bool(answers(m)), "stats")
        return answers(self)[0]


def _comparable(event: dict[str, Any]) -> tuple[Any, ...]:
    if event["t"] == "view":
        return ("view", tuple(event["members"]), tuple(event["joined"]), tuple(event["left"]))
    return ("msg", event["from"], event["tag"], event["len"], event["ok"])


def _count_from(sender: Member) -> Callable[[Member], Callable[[Member], int]]:
    def counter(member: Member) -> Callable[[Member], int]:
        return lambda m: sum(1 for r in m.messages if r["from"] == sender.me)

    return counter


@asynccontextmanager
async def open_members(bus: Bus) -> AsyncIterator[Callable[[int], Any]]:
    started: list[Member] = []
    async with trio.open_nursery() as nursery:

        async def start(node: int) -> Member:
            if bus.hub is not None:
                member: Member = await nursery.start(_serve_memory_member, bus.hub, node)
            else:
                process = await trio.lowlevel.open_process(
                    bus.member_argv(node), stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO
                )
                member = Member(node, process)
                nursery.start_soon(member.pump)
            started.append(member)
            await member.wait_for(lambda m: bool(m.views()), "first view")
            first = member.views()[0]
            assert member.me in first["members"], "the first event is the view that includes me"
            return member

        try:
            yield start
        finally:
            processes = [m.process for m in started if m.process is not None]
            for process in processes:
                if process.returncode is None:
                    process.kill()  # by pid; the driver has nothing to save
            with trio.move_on_after(10) as scope:
                scope.shield = True
                for process in processes:
                    await process.wait()
            nursery.cancel_scope.cancel()


async def _serve_memory_member(
    hub: MemoryBus, node: int, *, task_status: trio.TaskStatus[Member]
) -> None:
    """``member_driver.drive_member`` as a task on ``hub``; started with its Member."""
    lines, receive = trio.open_memory_channel[str](16)
    member = Member(node, lines=lines)

    @asynccontextmanager
    async def open_member() -> AsyncIterator[MemoryMember]:
        async with hub.join(node) as joined:
            try:
                yield joined
            finally:
                if member.task_scope is not None and member.task_scope.cancel_called:
                    hub.kill(joined.me)  # killed: gone without a goodbye

    with trio.CancelScope() as member.task_scope:
        task_status.started(member)
        await drive_member(open_member, receive, member.report)
    member.report({"t": "exit"})


def received(member: Member, total: int) -> Callable[[Member], bool]:
    return lambda m: len(m.messages) >= total


@pytest.mark.parametrize("bus", BACKENDS, indirect=True)
async def test_total_order_with_three_concurrent_senders(bus: Bus) -> None:
    async with open_members(bus) as start:
        members = [await start(node) for node in (1, 2, 3)]
        for member in members:
            await member.wait_for(lambda m: m.sees_members(3), "view of 3")
        for member in members:
            await member.command("send 150 300")
        for member in members:
            await member.wait_for(received(member, 450), "450 messages")
        everyone = {m.me for m in members}
        streams = [m.stream_from_view_with(everyone) for m in members]
        assert streams[0] == streams[1] == streams[2]
        assert sum(1 for e in streams[0] if e[0] == "msg") == 450
        for sender in members:
            tags = [e[2] for e in streams[0] if e[0] == "msg" and e[1] == sender.me]
            assert tags == [f"{sender.me}#{i}" for i in range(1, 151)]  # FIFO per sender
        assert all(e[4] for e in streams[0] if e[0] == "msg")


@pytest.mark.parametrize("bus", BACKENDS, indirect=True)
async def test_a_member_delivers_its_own_multicasts(bus: Bus) -> None:
    async with open_members(bus) as start:
        alone = await start(1)
        await alone.command("send 5 100")
        await alone.wait_for(received(alone, 5), "own 5 messages")
        assert [r["from"] for r in alone.messages] == [alone.me] * 5
        assert [r["tag"] for r in alone.messages] == [f"{alone.me}#{i}" for i in range(1, 6)]


@pytest.mark.parametrize("bus", BACKENDS, indirect=True)
async def test_what_a_member_multicast_before_leaving_is_delivered_before_its_leave(
    bus: Bus,
) -> None:
    # multicast returns once the message is queued (a socket's send buffer,
    # corosync's send buffer); leave must send the queue first.
    async with open_members(bus) as start:
        a, b = await start(1), await start(2)
        for member in (a, b):
            await member.wait_for(lambda m: m.sees_members(2), "view of 2")
        await a.command("send 300 8192")
        await a.wait_for(lambda m: any(r["t"] == "sent" for r in m.records), "all sent")
        await a.command("leave")
        await b.wait_for(lambda m: m.sees_members(1), "a's leave")
        stream = b.stream_from_view_with({a.me, b.me})
        tags = [e[2] for e in stream if e[0] == "msg" and e[1] == a.me]
        assert tags == [f"{a.me}#{i}" for i in range(1, 301)]
        assert stream[-1] == ("view", (b.me,), (), (a.me,))


@pytest.mark.parametrize("bus", BACKENDS, indirect=True)
async def test_view_changes_at_the_same_point_of_every_stream(bus: Bus) -> None:
    async with open_members(bus) as start:
        a, b = await start(1), await start(2)
        for member in (a, b):
            await member.wait_for(lambda m: m.sees_members(2), "view of 2")
        await a.command("send 400 200")
        await b.command("send 400 200")
        await a.wait_for(lambda m: len(m.messages) >= 50, "50 messages")
        c = await start(3)  # joins while a and b are multicasting
        await c.command("send 50 200")
        for member in (a, b):
            await member.wait_for(received(member, 850), "850 messages")
        await c.wait_for(lambda m: sum(r["from"] == c.me for r in m.messages) == 50, "own 50")
        stream_a = a.stream_from_view_with({a.me, b.me})
        assert stream_a == b.stream_from_view_with({a.me, b.me})
        joined = ("view", tuple(sorted([a.me, b.me, c.me], key=_member_key)), (c.me,), ())
        assert joined in stream_a, "a and b saw c join"
        cut = stream_a.index(joined)
        assert 0 < cut < len(stream_a) - 1, "the join landed inside the multicast stream"
        assert c.stream_from_view_with({a.me, b.me, c.me}) == stream_a[cut:]


def _member_key(text: str) -> tuple[int, int]:
    node, pid = text.split(".")
    return int(node), int(pid)


@pytest.mark.parametrize("bus", BACKENDS, indirect=True)
async def test_late_joiner_sees_its_view_and_everything_after(bus: Bus) -> None:
    async with open_members(bus) as start:
        a, b = await start(1), await start(2)
        await a.wait_for(lambda m: m.sees_members(2), "view of 2")
        await a.command("send 30 100")
        await b.wait_for(received(b, 30), "30 messages")
        c = await start(3)
        first = c.views()[0]
        assert set(first["members"]) == {a.me, b.me, c.me}
        assert first["joined"] == [c.me]
        assert c.events[0] == first, "nothing before the view that includes the joiner"
        await a.wait_for(lambda m: m.sees_members(3), "view of 3")
        await a.command("send 30 100")
        for member in (a, b, c):
            await member.wait_for(
                lambda m: sum(r["tag"] == f"{a.me}#60" for r in m.messages) == 1, "message 60"
            )
        everyone = {a.me, b.me, c.me}
        tail = a.stream_from_view_with(everyone)
        assert c.stream_from_view_with(everyone) == tail == b.stream_from_view_with(everyone)
        assert [e[2] for e in tail if e[0] == "msg"] == [f"{a.me}#{i}" for i in range(31, 61)]


@pytest.mark.parametrize("bus", BACKENDS, indirect=True)
async def test_sigkill_of_a_member_gives_survivors_one_view_change(bus: Bus) -> None:
    async with open_members(bus) as start:
        a, b, c = await start(1), await start(2), await start(3)
        for member in (a, b, c):
            await member.wait_for(lambda m: m.sees_members(3), "view of 3")
        everyone = {a.me, b.me, c.me}
        for member in (a, b, c):
            await member.command("send 300 200")
        await a.wait_for(lambda m: sum(r["from"] == c.me for r in m.messages) >= 20, "c's msgs")
        c.kill()
        for member in (a, b):
            await member.wait_for(lambda m: m.sees_members(2), "view of 2")
            await member.wait_for(
                lambda m: sum(r["from"] in (a.me, b.me) for r in m.messages) == 600, "600"
            )
        stream_a = a.stream_from_view_with(everyone)
        assert stream_a == b.stream_from_view_with(everyone)
        views = [e for e in stream_a if e[0] == "view"]
        assert views[1:] == [("view", tuple(sorted([a.me, b.me], key=_member_key)), (), (c.me,))]


@pytest.mark.parametrize("bus", BACKENDS, indirect=True)
async def test_five_megabyte_payloads_arrive_whole_and_in_order(bus: Bus) -> None:
    size = 5 * 1024 * 1024
    async with open_members(bus) as start:
        a, b = await start(1), await start(2)
        for member in (a, b):
            await member.wait_for(lambda m: m.sees_members(2), "view of 2")
        await a.command(f"send 2 {size}")
        await b.command(f"send 2 {size}")
        await b.command("send 5 100")  # small messages queue behind the large ones
        for member in (a, b):
            await member.wait_for(received(member, 9), "9 messages")
        stream = a.stream_from_view_with({a.me, b.me})
        assert stream == b.stream_from_view_with({a.me, b.me})
        big = [e for e in stream if e[0] == "msg" and e[3] == size]
        assert len(big) == 4
        assert all(e[4] for e in stream if e[0] == "msg"), "every payload arrived intact"
        for sender in (a, b):
            tags = [e[2] for e in stream if e[0] == "msg" and e[1] == sender.me]
            assert tags == sorted(tags, key=lambda t: int(t.split("#")[1]))


@pytest.mark.parametrize("bus", BACKENDS, indirect=True)
async def test_a_producer_against_a_paused_reader_keeps_buffers_bounded(bus: Bus) -> None:
    async with open_members(bus) as start:
        reader, producer = await start(1), await start(2)
        await reader.wait_for(lambda m: m.sees_members(2), "view of 2")
        await reader.command("pause")  # the application reads nothing until resumed
        await producer.command("send 1500 4096")
        # 6 MB that nobody reads: the bus must push back somewhere, the
        # reader's member refusing more than its queue holds (embedded,
        # memory) or the producer's multicast waiting for the bus (corosync,
        # whose library holds the rest) -- never buffering without bound.
        with trio.fail_after(TIMEOUT_S):
            while True:
                paused, sending = await reader.stats(), await producer.stats()
                if paused["send_waits"] or sending["send_waits"]:
                    break
                await trio.sleep(0.01)  # polling two processes' statistics
        assert paused["events_queued_max"] <= paused["events_queue_limit"] <= 1024
        assert len(reader.messages) <= 1  # the one read before the pause took hold
        await reader.command("resume")
        await reader.wait_for(received(reader, 1500), "1500 messages")
        await producer.wait_for(received(producer, 1500), "1500 messages")
        for member in (reader, producer):
            stats = await member.stats()
            assert stats["events_queued_max"] <= stats["events_queue_limit"]
            assert stats["pending_reassembly_bytes"] == 0
        assert all(r["ok"] for r in reader.messages)
        assert [r["tag"] for r in reader.messages] == [f"{producer.me}#{i}" for i in range(1, 1501)]


@pytest.mark.corosync
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("bus", [BACKENDS[1]], indirect=True)
async def test_cut_off_node_loses_quorum_and_views_merge_when_restored(bus: Bus) -> None:
    site = bus.site
    assert site is not None
    async with open_members(bus) as start:
        a, b, c = await start(1), await start(2), await start(3)
        for member in (a, b, c):
            await member.wait_for(lambda m: m.sees_members(3), "view of 3")
            assert member.views()[-1]["q"] is True
        site.cut(3)
        try:
            await c.wait_for(
                lambda m: m.views()[-1]["members"] == [c.me] and not m.views()[-1]["q"],
                "non-quorate view of itself alone",
            )
            for member in (a, b):
                await member.wait_for(lambda m: m.sees_members(2), "view of 2")
                assert member.views()[-1]["q"] is True
                assert member.views()[-1]["left"] == [c.me]
            await a.command("send 20 100")
            for member in (a, b):
                await member.wait_for(received(member, 20), "20 messages in the majority")
        finally:
            site.restore(3)
        for member in (a, b, c):
            await member.wait_for(
                lambda m: m.sees_members(3) and m.views()[-1]["q"], "merged quorate view of 3"
            )
        assert not [r for r in c.messages if r["from"] == a.me], "c was cut off: none of a's"
        everyone = {a.me, b.me, c.me}
        await a.command("send 10 100")
        for member in (a, b, c):
            await member.wait_for(
                lambda m: sum(r["tag"] == f"{a.me}#30" for r in m.messages) == 1, "message 30"
            )
        # The merge view: each side sees the other side join; after it, one stream.
        merged = [[_comparable(e) for e in m.events[-11:]] for m in (a, b, c)]
        assert [e[1] for e in merged[0][:1]] == [tuple(sorted(everyone, key=_member_key))]
        assert merged[0][0] == merged[1][0]
        assert merged[0][0][2] == (c.me,)
        assert merged[2][0][2] == tuple(sorted([a.me, b.me], key=_member_key))
        assert merged[0][0][1] == merged[2][0][1]
        assert merged[0][1:] == merged[1][1:] == merged[2][1:]
        assert all(e[0] == "msg" for e in merged[0][1:])
    site.wait_membership()
