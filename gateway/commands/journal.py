"""``drgate journal``: a broker's journal, for its operator (docs/broker.md,
"Durability").

``drgate journal check --config BROKER.yaml``
    What the journal holds (checkpoint cseq, last cseq, bytes) and whether
    the broker would start on it: a torn tail (a crash mid-write, cut at the
    next start) or the damage it would refuse, with the file and byte offset.
    Changes nothing; safe while the broker runs.  Exit 0 when a start would
    accept the journal, 1 when it is damaged.

``drgate journal reseed --config BROKER.yaml``
    For a damaged journal: refuses while the broker runs (it holds
    ``journal.lock``), then moves the journal directory aside to
    ``<directory>.damaged-<UTC time>`` (kept for analysis).  Started again,
    the broker begins with an empty journal and takes the site's state from
    its peers; if the whole site is down, the other brokers' journals recover
    it.  A journal a start would accept is left alone unless
    ``--even-if-healthy``: what it holds may be the site's most advanced copy.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from cluster.journal import JournalError, JournalReport, inspect_journal, lock_directory
from cluster.node import BrokerConfig
from gateway.brokerconfig import load_broker_config
from protocol.errors import DrgateError

NAME = "journal"
HELP = "check a broker's journal, or move a damaged one aside so the broker re-seeds from its peers"

DAMAGED_INFIX = ".damaged-"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="journal_command", metavar="ACTION", required=True)
    check = sub.add_parser(
        "check", help="say what the journal holds and whether the broker starts on it"
    )
    reseed = sub.add_parser(
        "reseed",
        help="move a damaged journal aside: the broker, started again, takes the state "
        "from its peers",
    )
    for action in (check, reseed):
        action.add_argument("--config", required=True, metavar="FILE", help="the broker's config")
    reseed.add_argument(
        "--even-if-healthy",
        action="store_true",
        help="move the journal aside even though the broker would start on it",
    )


def run(args: argparse.Namespace) -> int:
    config = load_broker_config(args.config)
    if config.journal is None:
        raise DrgateError(
            f"{args.config}: broker node {config.node} of {config.cluster} keeps no journal "
            "(no 'journal:' section): nothing to check or reseed"
        )
    directory = Path(config.journal.directory)
    if args.journal_command == "check":
        report = inspect_journal(directory)
        print(describe(report, config))
        return 0 if report.damage is None else 1
    print(reseed(directory, config, config_path=args.config, even_if_healthy=args.even_if_healthy))
    return 0


def describe(report: JournalReport, config: BrokerConfig) -> str:
    """``report`` for people, one fact a line."""
    torn = report.torn_tail
    lines = [
        f"journal of broker node {config.node} of {config.cluster}: {report.directory}",
        "  in use: " + ("yes, by a running broker" if report.in_use else "no"),
        "  checkpoint: " + (f"cseq {report.checkpoint_cseq}" if report.checkpoint_cseq else "none"),
        f"  last cseq: {report.last_cseq}",
        f"  on disk: {report.bytes_on_disk} bytes in {report.files} files",
        "  torn tail: "
        + (
            "none"
            if torn is None
            else f"{torn.path} at byte offset {torn.offset}, {torn.dropped_bytes} bytes "
            f"({torn.reason}): "
            + (
                "the record being written now"
                if report.in_use
                else "a crash mid-write; the next start cuts it"
            )
        ),
        "  damage: " + ("none" if report.damage is None else str(report.damage)),
    ]
    if report.damage is None:
        lines.append("the broker starts on this journal")
    else:
        lines.append("the broker refuses to start on this journal: drgate journal reseed")
    return "\n".join(lines)


def reseed(
    directory: Path, config: BrokerConfig, *, config_path: str, even_if_healthy: bool = False
) -> str:
    """Move ``directory`` aside (see the module docstring); what happens next,
    for people.  Raises :class:`DrgateError` while the broker runs, when there
    is no journal, or for a healthy journal without ``even_if_healthy``."""
    if not directory.is_dir():
        raise DrgateError(
            f"{directory}: no journal directory there: broker node {config.node} starts with "
            "an empty journal anyway, nothing to reseed"
        )
    lock = _hold(directory, config)
    try:
        report = inspect_journal(directory)
        if report.damage is None and not even_if_healthy:
            raise DrgateError(
                f"{directory}: the journal is not damaged (last cseq {report.last_cseq}; "
                f"drgate journal check --config {config_path}): the broker starts on it. "
                "Moving it aside would throw away what may be the site's most advanced "
                "copy; add --even-if-healthy to do it anyway"
            )
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = directory.with_name(directory.name + DAMAGED_INFIX + stamp)
        if aside.exists():
            raise DrgateError(f"{aside} exists already: run again in a second")
        directory.rename(aside)
    finally:
        os.close(lock)
    return "\n".join(
        [
            f"moved {directory} aside to {aside} (kept for analysis: delete it when done)",
            f"next: start broker node {config.node} (drgate broker --config {config_path}); "
            "it begins with an empty journal:",
            f"  * {config.cluster} running: the broker joins it and takes the state from its "
            "peers, then journals from there; nothing is lost",
            f"  * {config.cluster} down as a whole: start its other brokers too; the site "
            "continues from the most advanced of their journals (what only this journal "
            "held is lost). If another broker is gone for good, "
            f"drgate recover --force --config {config_path}",
        ]
    )


def _hold(directory: Path, config: BrokerConfig) -> int:
    """Take the journal's lock (as a starting broker does), or refuse."""
    try:
        return lock_directory(directory)
    except JournalError:
        raise DrgateError(
            f"{directory}: broker node {config.node} of {config.cluster} is running on this "
            "journal (it holds journal.lock). Stop it first, then run drgate journal reseed "
            "again"
        ) from None
