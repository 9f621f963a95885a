"""Watching the rules file of a running sidecar (docs/rules.md, "Switching
rules at run time").

Every primary sidecar looks at its rules file once a second (``stat``: its
modification time, size and inode; an editor that writes a new file and
renames it is seen too).  When it changed, the new text is decided against
the rules *in force* (those the site's stream applied last, not the file the
sidecar started with) by :func:`filters.switch.decide_switch`:

* the same text: nothing to do;
* invalid: the rules in force stay; the problems are logged once for each
  distinct content, counted, and reported until the file is valid again;
* valid and different: the sidecar multicasts a ``RulesSwitch`` command and
  every tap of the site applies it at that command's ``cseq``.

Several sidecars that see the same change may each propose it; the first
delivered switches the rules and the later ones carry the same text, which
``apply_switch`` ignores.  Nothing is proposed from a minority partition.

The class is synchronous and does no I/O but ``stat`` and one read of a
changed file; the sidecar calls :meth:`RulesWatcher.poll` from its own task.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from filters.matcher import RuleSet
from filters.switch import (
    RulesPayload,
    SwitchAccepted,
    SwitchRefused,
    SwitchUnchanged,
    decide_switch,
)

log = logging.getLogger("drgate.rules")

POLL_S = 1.0


def file_stamp(path: str) -> tuple[int, int, int] | None:
    """What changes when a file is edited (modification time, size, inode: an
    editor that writes a new file and renames it too); None when absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


@dataclass(slots=True)
class RulesWatcher:
    path: str
    failures: int = 0  # distinct invalid contents seen
    problem: str = ""  # why the file on disk is not in force ("" when it is)
    _seen: tuple[int, int, int] | None = None
    _refused: str = ""

    def start_from(self) -> None:
        """Take the file as it is now as seen (it is the file loaded at start)."""
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        return file_stamp(self.path)

    def poll(self, in_force: RuleSet) -> RulesPayload | None:
        """The switch to propose, if the file changed into valid new rules."""
        stamp = self._stamp()
        if stamp == self._seen:
            return None
        self._seen = stamp
        try:
            with open(self.path, encoding="utf-8") as file:
                text = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            self._refuse(
                f"cannot read the rules file {self.path}: {exc}; the rules in force stay",
                key=f"unreadable {exc}",
            )
            return None
        decision = decide_switch(in_force, text, self.path)
        if isinstance(decision, SwitchUnchanged):
            self._clear()
            return None
        if isinstance(decision, SwitchRefused):
            details = "; ".join(str(p) for p in decision.problems)
            self._refuse(
                f"the rules file {self.path} changed but is invalid, so the rules in force "
                f"(version {in_force.rules_version}) stay: {details}",
                key=decision.digest,
            )
            return None
        assert isinstance(decision, SwitchAccepted)
        self._clear()
        for warning in decision.warnings:
            log.warning("rules: %s", warning)
        log.info(
            "rules: %s changed; proposing version %d to the site",
            self.path,
            decision.payload.rules_version,
        )
        return decision.payload

    def _refuse(self, text: str, *, key: str) -> None:
        self.problem = text
        if key != self._refused:
            self._refused = key
            self.failures += 1
            log.error("%s", text)

    def _clear(self) -> None:
        self.problem = ""
        self._refused = ""
