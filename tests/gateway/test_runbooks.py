"""The runbooks of docs/operations.md ("Runbooks"), run as written.

Each runbook is a ``sh`` block whose ``# at P`` / ``# at D`` comments say
where the commands under them run; this test reads the blocks from the
document, puts the lab's paths where the document has placeholders, runs
every command at the site its comment names and checks what the comments
say an operator will see (``drgate status``, HTTP only, from the test's
own shell, which reaches both sites).  The failback's command at P is the one the
command at D printed (the document's ``--epoch 3`` is an example), and so is
the failback by delta's (``--after 18231``; its ``--out`` goes to the lab).

Two sites of three brokers and three sidecars (lab.site.TwoSites); on
corosync too (``make test-long``), where each command runs in node 1's
namespace as an operator's shell on that host would.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.site import ROOT, BrokerSite, TwoSites, drgate_argv
from tests import lab
from tests.gateway.test_promote import add_queues
from tests.lab import converged, queues, status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

OPERATIONS = ROOT / "docs" / "operations.md"
CONFIG = "/etc/drgate/sidecar.yaml"
PRINTED_FAILBACK = re.compile(r"drgate failback --epoch (\d+) --config <[^>]+>")
PRINTED_DELTA = re.compile(r"drgate failback --delta --after (\d+) --out DIR")


def runbook(title: str) -> list[tuple[str, str]]:
    """The commands of ``### Runbook: TITLE…`` as (site letter, command line)."""
    text = OPERATIONS.read_text()
    start = text.index(f"### Runbook: {title}")
    block = text[text.index("```sh\n", start) + len("```sh\n") :]
    block = block[: block.index("```")]
    steps, site = [], ""
    for line in block.splitlines():
        if line.startswith("# at "):
            site = line.removeprefix("# at ")[0]
        elif line.strip():
            assert site in ("P", "D"), f"runbook {title!r}: {line!r} says no site"
            steps.append((site, line))
    assert steps, f"runbook {title!r} has no commands"
    return steps


class Operator:
    """Types the runbooks' commands at the sites' node 1."""

    def __init__(self, two: TwoSites) -> None:
        self.two = two
        self.printed = ""  # what the last command printed

    def run(self, title: str) -> list[str]:
        """Run the runbook ``title``; what each command printed."""
        return [self._command(site, line) for site, line in runbook(title)]

    def _command(self, letter: str, line: str) -> str:
        site = self.two.p if letter == "P" else self.two.d
        words = shlex.split(line)
        assert words[0] == "drgate", line
        args = [self._place(word, site) for word in words[1:]]
        if args[:2] == ["failback", "--epoch"]:
            printed = PRINTED_FAILBACK.search(self.printed)
            assert printed, f"the failback at D printed no command for P: {self.printed}"
            args[2] = printed.group(1)
        if args[:3] == ["failback", "--delta", "--after"]:
            printed = PRINTED_DELTA.search(self.printed)
            assert printed, f"the failback at D printed no command for P: {self.printed}"
            args[3] = printed.group(1)
        if args[0] == "status":  # HTTP only: from the operator's shell, which reaches both sites
            argv = drgate_argv(*args)
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
            )
        else:  # the commands that join the site's bus: on a host of that site
            done = site.drgate(1, *args, timeout=240)
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
        self.printed = done.stdout
        return done.stdout

    def _place(self, word: str, site: BrokerSite) -> str:
        if word == CONFIG:
            return str(site.workdir / "sidecar-1.yaml")
        if word.startswith("/var/tmp/"):  # where the operator records things: the lab's
            return str(site.workdir / word.removeprefix("/var/tmp/"))
        for letter, cluster in (("P", "site-p"), ("D", "site-d")):
            if word == f"http://{letter}-SIDECAR:9465":
                return self.two.status_url(cluster, 1).removesuffix("/status")
        return word


@pytest.fixture(params=lab.BUSES)
def two(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TwoSites]:
    lab.require_bus(request.param)
    # Configs that link both ways: the switchover swaps the sites in place.
    with TwoSites(workdir=tmp_path, metrics=True, bus=request.param, reversible=True) as sites:
        add_queues(sites)
        yield sites


def accepted(site: BrokerSite, queue: str, count: int, prefix: str) -> int:
    got = site.client(1, "publish", site.amqp[1], queue, "--count", str(count), "--prefix", prefix)
    return int(got["accepted"])


def failed_back(two: TwoSites) -> None:
    """What the failback runbook's last comment says: the wait ends, and P's
    consumers take messages again."""
    wait_for(
        "P's failback_wait_cseq is 0 again",
        lambda: status(two, "site-p", 1)["failback_wait_cseq"] == 0,
    )
    assert accepted(two.p, "q-enq", 1, "after") == 1
    got: list[str] = []

    def consumed() -> bool:
        taken = two.p.client(1, "consume", two.p.amqp[1], "q-enq", "--count", "1", "--idle", "5")
        got.extend(taken["ids"])
        return bool(got)

    wait_for("a consumer at P takes a message", consumed)


def test_the_runbooks_run_as_written(two: TwoSites) -> None:
    operator = Operator(two)
    assert accepted(two.p, "q-full", 20, "before") == 20
    wait_for("D's full replica equals P's queue", lambda: converged(two))

    # Planned switchover: D is the primary, P its DR site.
    printed = operator.run("planned switchover")
    assert "done: site-d is the primary and site-p its DR site" in printed[0], printed[0]
    assert status(two, "site-d", 1)["role"] == "egress"
    assert status(two, "site-p", 1)["role"] == "ingress"
    assert accepted(two.d, "q-full", 1, "at-d") == 1
    assert accepted(two.p, "q-full", 1, "refused") == 0  # a read-only replica now
    wait_for("P's full replica equals D's queue", lambda: converged(two))

    # Switch back: P is the primary again, D its DR site, both streams kept.
    printed = operator.run("switch back")
    assert "done: site-p is the primary and site-d its DR site" in printed[0], printed[0]
    assert status(two, "site-p", 1)["role"] == "egress"
    assert status(two, "site-d", 1)["role"] == "ingress"
    assert accepted(two.p, "q-full", 1, "back") == 1
    wait_for("D's full replica equals P's queue", lambda: converged(two))
    assert queues(two.d.describe(2))["q-full"]["depth"] == 22

    # Failover with P cut off: D promoted, its full replica writable.
    two.wan_all("cut")
    printed = operator.run("failover")
    assert "cseq" in printed[0], printed[0]  # the dry run's figures
    assert accepted(two.d, "q-full", 1, "promoted") == 1

    # The link comes back: split brain, parked on both sides, nothing merged.
    two.wan_all("restore")
    wait_for(
        "P's egress and D's ingress report the split brain",
        lambda: (
            status(two, "site-p", 1)["partitioned"]
            and any(status(two, "site-d", n)["partitioned"] for n in two.nodes)
        ),
    )
    d_before = queues(two.d.describe(1))["q-full"]["digest"]
    printed = operator.run("split brain")
    assert "site-d" in printed[0] and "site-p" in printed[0], printed[0]
    assert queues(two.d.describe(1))["q-full"]["digest"] == d_before

    # Failback again: D takes P's state.
    operator.run("failback")
    failed_back(two)
    wait_for("D's full replica equals P's queue", lambda: converged(two))

    # Another failover, P cut off with messages D never gets; D takes writes.
    two.wan_all("cut")
    assert accepted(two.p, "q-full", 5, "stranded") == 5
    operator.run("failover")
    assert accepted(two.d, "q-full", 2, "promoted-again") == 2
    two.wan_all("restore")

    # Failback by delta: P records its tail and becomes D's DR site.
    printed = operator.run("failback by delta")
    assert "drgate failback --delta --after" in printed[0], printed[0]
    assert "{'q-full': 5}" in printed[1] and "a whole resync would have shipped" in printed[1]
    assert status(two, "site-d", 1)["role"] == "egress"
    assert status(two, "site-p", 1)["role"] == "ingress"
    assert accepted(two.d, "q-full", 1, "d-primary") == 1  # D's queues stay open
    # Equal digests: P's 5 stranded messages are gone from it (in the tail).
    wait_for("P's full replica equals D's queue", lambda: converged(two))

    # And a switchover makes it the primary again.
    printed = operator.run("switch back")
    assert "done: site-p is the primary and site-d its DR site" in printed[0], printed[0]
    assert accepted(two.p, "q-full", 1, "home") == 1
    wait_for("D's full replica equals P's queue", lambda: converged(two))
