"""The chaos run's Spark audit: the sidecars' capture segments, checked by
``analysis.jobs audit`` (docs/analysis.md) in a process of its own.

Every P event the egress forwarded must have been applied at D once and in
order, and nothing the rules filter may have been forwarded; the audit says
which events its captures cannot judge (a sidecar killed with records
unwritten, a resync's snapshot) and those are counted, not violations.  The
clients' records and the queues are the checker's (tests/chaos/checker.py);
this is the same claim read from what the sidecars saw.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A 200-fault run captures a few hundred MB: Spark reads them in minutes.
AUDIT_TIMEOUT_S = 1800.0
SHOWN = 5  # violations named one by one; the rest are in the report


@dataclass
class AuditResult:
    """What the audit of one run found; ``problems`` empty when it is clean."""

    problems: list[str] = field(default_factory=list)
    forwarded: int = 0  # (event, queue) pairs P's egresses forwarded
    applied: int = 0  # applications at D
    not_captured: Counter[str] = field(default_factory=Counter)  # why -> events
    report: Path | None = None

    def summary(self) -> str:
        unjudged = ", ".join(f"{n} {why}" for why, n in self.not_captured.most_common()) or "none"
        verdict = f"{len(self.problems)} violation(s)" if self.problems else "clean"
        return (
            f"Spark audit of the captures: {verdict}; {self.forwarded} (event, queue) forwarded, "
            f"{self.applied} applied at D; not judged: {unjudged}"
        )


def run_audit(captures: Path, out: Path, timeout_s: float = AUDIT_TIMEOUT_S) -> AuditResult:
    """``analysis.jobs audit`` over ``captures`` into ``out``, its tables read back."""
    argv = [sys.executable, "-m", "analysis.jobs", "audit", "--captures", str(captures)]
    done = subprocess.run(
        [*argv, "--out", str(out)],
        capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False,
    )  # fmt: skip
    tables = out / "audit" / "tables"
    if done.returncode not in (0, 1) or not (tables / "violations.csv").exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return AuditResult(
            problems=[f"the Spark audit failed (exit {done.returncode}): {' | '.join(tail)}"]
        )
    return read_tables(tables, out / "audit" / "report.html")


def read_tables(tables: Path, report: Path) -> AuditResult:
    result = AuditResult(report=report)
    violations = _rows(tables / "violations.csv")
    result.problems = [
        f"audit: {v['violation']} {v['queue']} origin {v['origin_incarnation']} cseq {v['cseq']} "
        f"({v['kind_name']}): {v['detail']}"
        for v in violations[:SHOWN]
    ]
    if len(violations) > SHOWN:
        result.problems.append(f"audit: {len(violations) - SHOWN} more violations in {report}")
    for row in _rows(tables / "not_captured.csv"):
        why = "in a resync snapshot" if "resync" in row["detail"] else "not captured"
        result.not_captured[why] += 1
    for row in _rows(tables / "per_queue.csv"):
        result.forwarded += int(row["forwarded"])
        result.applied += int(row["applied"])
    return result


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))
