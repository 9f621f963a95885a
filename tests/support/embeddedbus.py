"""An embedded site bus run in the test's own process: a sequencer on
loopback TCP with a site key made for it (cluster/bus/auth.py), and the
``BusConfig`` its members join with."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import trio

from cluster.addresses import Address
from cluster.bus import BusConfig
from cluster.bus.auth import read_key_file, write_key_file
from cluster.bus.embedded import SequencerServer


@dataclass
class EmbeddedSite:
    """A running sequencer (``server``), the nursery it runs in, and how to join it."""

    nursery: trio.Nursery
    server: SequencerServer
    bus: BusConfig  # node 1, the site's key
    folder: Path  # where the key file is; a test may put others beside it

    def config(self, *, node: int = 1, key_file: str | Path | None = None) -> BusConfig:
        """The site's bus for ``node``, with another key file when given."""
        key = self.bus.key_file if key_file is None else str(key_file)
        return BusConfig("embedded", self.bus.group, node, self.bus.address, key)

    def other_key(self, name: str = "other.key") -> str:
        """A key file that is not the site's (a stranger's)."""
        path = str(self.folder / name)
        write_key_file(path)
        return path


@contextlib.asynccontextmanager
async def open_embedded_site(group: str = "site") -> AsyncIterator[EmbeddedSite]:
    """A sequencer of ``group`` with a new key; stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="drgate-bus-") as folder:
        key_file = str(Path(folder) / "bus.key")
        write_key_file(key_file)
        server = SequencerServer(group, key=read_key_file(key_file))
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(functools.partial(server.serve, "127.0.0.1", 0))
            bus = BusConfig("embedded", group, 1, Address(host, port), key_file)
            yield EmbeddedSite(nursery, server, bus, Path(folder))
            nursery.cancel_scope.cancel()
