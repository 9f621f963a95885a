"""A bus member driven by line commands on stdin, reporting JSON lines on stdout.

Used by the contract suite to run members as separate processes, inside a
lab node's network namespace for the corosync backend; ``drive_member`` runs
the same member in-process on the memory bus (tests/support/membus.py).

stdin commands:   send COUNT SIZE   multicast COUNT payloads of SIZE bytes
                  pause             stop reading events (until resume)
                  resume            read events again
                  stats             print the member's statistics
                  leave             leave the group and exit
stdout lines:     {"t": "me", "me": "1.2"}
                  {"t": "view", "id", "members", "joined", "left", "q"}
                  {"t": "msg", "from": "1.2", "tag": "1.2|7", "len": N, "ok": bool}
                  {"t": "sent", "n": COUNT}, {"t": "stats", ...}, {"t": "error", "text"}

A payload is ``TAG|`` followed by a filler that depends on the tag, so the
receiver can check it arrived whole (``ok``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from cluster.addresses import parse_address
from cluster.bus import BusConfig, BusEvent, BusMember, Delivery, open_bus
from protocol.errors import BusError
from protocol.modes import Role


def make_payload(tag: str, size: int) -> bytes:
    head = f"{tag}|".encode()
    seed = (sum(head) % 251).to_bytes(1, "big")
    filler = (seed + bytes(range(256))) * (size // 257 + 1)
    return (head + filler)[: max(size, len(head))]


def check_payload(payload: bytes) -> tuple[str, bool]:
    tag = payload.split(b"|", 1)[0].decode("ascii", "replace")
    return tag, payload == make_payload(tag, len(payload))


def emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def event_record(event: BusEvent) -> dict[str, object]:
    if isinstance(event, Delivery):
        tag, ok = check_payload(event.payload)
        return {
            "t": "msg",
            "from": str(event.sender),
            "tag": tag,
            "len": len(event.payload),
            "ok": ok,
        }
    return {
        "t": "view",
        "id": event.view_id,
        "members": [str(m) for m in event.members],
        "joined": [str(m) for m in event.joined],
        "left": [str(m) for m in event.left],
        "q": event.quorate,
    }


async def drive_member(
    open_member: Callable[[], AbstractAsyncContextManager[BusMember]],
    lines: AsyncIterator[str],
    report: Callable[[dict[str, object]], None],
) -> int:
    """Join with ``open_member()``, obey the command ``lines`` and ``report``
    records (see the module docstring) until the stream or the lines end.
    Returns the exit status: 0, or 2 after reporting a ``BusError``."""
    reading = [trio.Event()]  # a fresh, unset one while paused: the application reads nothing
    reading[0].set()
    sent = [0]
    try:
        async with open_member() as member, trio.open_nursery() as nursery:
            report({"t": "me", "me": str(member.me)})

            async def send(count: int, size: int) -> None:
                for _ in range(count):
                    sent[0] += 1
                    await member.multicast(make_payload(f"{member.me}#{sent[0]}", size))
                report({"t": "sent", "n": count})

            async def commands() -> None:
                async for line in lines:
                    words = line.split()
                    if not words:
                        continue
                    if words[0] == "send":
                        nursery.start_soon(send, int(words[1]), int(words[2]))
                    elif words[0] == "pause":
                        reading[0] = trio.Event()
                    elif words[0] == "resume":
                        reading[0].set()
                    elif words[0] == "stats":
                        stats = member.statistics()  # type: ignore[attr-defined]
                        report({"t": "stats", **dataclasses.asdict(stats)})
                    elif words[0] == "leave":
                        await member.leave()
                        report({"t": "left"})
                nursery.cancel_scope.cancel()

            nursery.start_soon(commands)
            async for event in member.events():
                report(event_record(event))
                await reading[0].wait()  # a paused application
            report({"t": "end"})
            nursery.cancel_scope.cancel()
    except BusError as exc:
        report({"t": "error", "text": str(exc)})
        return 2
    return 0


async def stdin_lines() -> AsyncIterator[str]:
    stdin = trio.lowlevel.FdStream(0)
    buffer = b""
    while data := await stdin.receive_some(4096):
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode()


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--address")
    parser.add_argument("--key-file")
    args = parser.parse_args()
    address = None if args.address is None else parse_address(args.address, key="--address")
    config = BusConfig(args.backend, args.group, args.node, address, args.key_file)
    return await drive_member(lambda: open_bus(config, role=Role.ADMIN), stdin_lines(), emit)


if __name__ == "__main__":
    sys.exit(trio.run(main))
