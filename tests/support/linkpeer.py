"""Stand-ins for the fast tests of the egress and the ingress: a bus member that
applies what it is given to a real site state, and a sans-IO link end driven
over an in-memory stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from cluster import state as st
from cluster.addresses import Address
from cluster.bus import BusConfig
from filters.rules import load_rules
from gateway.sidecarconfig import SidecarConfig
from protocol import cluster as pc
from protocol import link
from protocol.modes import Mode
from tests.support.state import Member

RULES = """\
version: 1
rules:
  - name: full
    match: {queue: "q-full"}
    action: {mode: full}
  - name: enqueue
    match: {queue: "q-enq"}
    action: {mode: enqueue}
default: {mode: none}
"""


def sidecar_config(
    tmp_path: Path, *, primary: bool, site: str, peer: str, node: int = 1
) -> SidecarConfig:
    """A sidecar of ``site`` on ``node`` (its spool in ``tmp_path/spool-NODE``)."""
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(RULES)
    return SidecarConfig(
        site=site,
        primary=primary,
        node=node,
        bus=BusConfig(backend="memory", group=site, node=node),
        peer_cluster=peer,
        peers=(Address("d1", 1), Address("d2", 1)),
        listen=None if primary else Address("127.0.0.1", 0),
        spool_dir=str(tmp_path / f"spool-{node}"),
        spool_max_bytes=1 << 20,
        fsync="never",
        rules=load_rules(RULES, str(rules_file)),
    )


@dataclass
class MemberStandIn:
    """A bus member of one: commands are applied to ``state`` at once, in
    order; ``gate``, when set, holds every ``submit_and_wait`` until it opens."""

    cluster: str
    state: st.SiteState = field(default_factory=st.new_state)
    posted: list[pc.Command] = field(default_factory=list)
    applied: list[pc.Command] = field(default_factory=list)
    gate: trio.Event | None = None
    bus_config: BusConfig = field(default_factory=lambda: BusConfig("memory", "site", 1))

    def __post_init__(self) -> None:
        self.apply(pc.Genesis(self.cluster, 1))

    def apply(self, *commands: pc.Command) -> list[Any]:
        effects: list[Any] = []
        for cmd in commands:
            effects.extend(st.apply(self.state, cmd, sender=Member(9, 9)))
            self.applied.append(cmd)
        return effects

    def post(self, cmd: pc.Command) -> None:
        self.posted.append(cmd)

    async def submit(self, *commands: pc.Command) -> None:
        self.apply(*commands)

    async def submit_and_wait(self, *commands: pc.Command) -> int:
        if self.gate is not None:
            await self.gate.wait()
        self.apply(*commands)
        return self.state.cseq

    async def submit_frames_and_wait(self, frames: list[bytes]) -> int:
        """As :meth:`SiteMember.submit_frames_and_wait`: the frames' commands,
        through :meth:`submit_and_wait` (so a stand-in overriding it sees them)."""
        commands = [cmd for frame in frames for cmd in pc.decode_frame_untrusted(frame)]
        return await self.submit_and_wait(*commands)


class _Never:
    """No event is one."""


class LinkEnd:
    """One sans-IO link machine (a LinkSender or a LinkReceiver) on a stream."""

    def __init__(self, machine: Any, stream: trio.abc.Stream) -> None:
        self.machine = machine
        self.stream = stream
        self.events: list[Any] = []

    async def flush(self) -> None:
        out = self.machine.data_to_send(trio.current_time())
        if out:
            await self.stream.send_all(out)

    async def pump_for(self, seconds: float) -> None:
        """Keep the link going (acks, pings) for ``seconds`` of virtual time."""
        with trio.move_on_after(seconds):
            await self.next_of(_Never, within=seconds + 1)

    async def next_of(self, kind: type | tuple[type, ...], *, within: float = 30.0) -> Any:
        """Pump until the machine hands out an event of ``kind`` (others are
        kept in ``events``); fails after ``within`` seconds (virtual time)."""
        with trio.fail_after(within):
            while True:
                while True:
                    ev = self.machine.next_event()
                    if ev is link.NEED_DATA:
                        break
                    self.events.append(ev)
                    if isinstance(ev, kind):
                        return ev
                await self.flush()
                deadline = self.machine.tick(trio.current_time())
                with trio.move_on_at(deadline if deadline is not None else trio.current_time() + 1):
                    data = await self.stream.receive_some(1 << 16)
                    if not data:
                        raise trio.BrokenResourceError("the other end closed the link")
                    self.machine.receive_data(bytes(data))


def replicated(seq: int, *, origin: str = "site-p", epoch: int = 1, incarnation: int = 5) -> bytes:
    """A link event's payload: one Replicated declare of q-full at ``seq``."""
    cmd = pc.Replicated(
        origin, incarnation, seq, epoch, 1_000 * seq, (Mode.FULL,), (pc.QueueDeclare("q-full"),)
    )
    return pc.encode_frame([cmd])
