"""Re-reading a primary sidecar's ``peers`` at run time (docs/operations.md,
"Adding or moving a D sidecar").

Every primary sidecar looks at its config file once a second (its
modification time, size and inode, as for the rules file).  When it changed,
the file is loaded again with every check ``drgate run`` makes:

* unreadable or invalid: the peers in use stay; the problems are logged once
  for each distinct content and shown in ``/status`` ``last_error`` until the
  file is valid again;
* valid, with other ``peers``: they replace the ones in use.  The egress tries
  them from its next connection attempt on; a link that is up stays up while
  its peer is still listed, and is ended when it is not;
* any other setting that changed takes effect at the next start (logged).

The class is synchronous and does no I/O but ``stat`` and the load of a
changed file; the sidecar calls :meth:`PeersWatcher.poll` from its own task.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.ruleswatch import file_stamp
from protocol.errors import ConfigError

if TYPE_CHECKING:  # the sidecar imports this module
    from cluster.addresses import Address
    from gateway.sidecarconfig import SidecarConfig

log = logging.getLogger("drgate.peers")


@dataclass(slots=True)
class PeersWatcher:
    config: SidecarConfig  # as the sidecar started with it
    problem: str = ""  # why the file on disk is not in use ("" when it is)
    _seen: tuple[int, int, int] | None = None
    _refused: str = ""

    def start_from(self) -> None:
        """Take the file as it is now as seen (it is the file loaded at start)."""
        self._seen = file_stamp(self.config.source)

    def poll(self, in_use: tuple[Address, ...]) -> tuple[Address, ...] | None:
        """The new peers, if the file changed into a valid config with others."""
        stamp = file_stamp(self.config.source)
        if stamp == self._seen:
            return None
        self._seen = stamp
        from gateway.config import load_sidecar_config  # config imports the sidecar

        try:
            loaded = load_sidecar_config(self.config.source)
        except ConfigError as exc:
            self._refuse(
                f"the sidecar config {self.config.source} changed but cannot be used, so the "
                f"peers in use stay ({', '.join(map(str, in_use))}): {exc}"
            )
            return None
        self.problem, self._refused = "", ""
        same_otherwise = dataclasses.replace(loaded, peers=(), rules=self.config.rules) == (
            dataclasses.replace(self.config, peers=())
        )
        if not same_otherwise:
            log.warning(
                "peers: %s changed more than 'peers'; the other changes take effect when the "
                "sidecar restarts",
                self.config.source,
            )
        if loaded.peers == in_use:
            return None
        log.info(
            "peers: %s changed; D's sidecars are now %s (were %s)",
            self.config.source,
            ", ".join(map(str, loaded.peers)),
            ", ".join(map(str, in_use)),
        )
        return loaded.peers

    def _refuse(self, text: str) -> None:
        self.problem = text
        if text != self._refused:
            self._refused = text
            log.error("%s", text)
