"""What a forced failover discarded (docs/operations.md, "What a failover
discarded"): P cut off from D accepts 50 messages D never gets, D is
promoted, and ``drgate divergence`` at P, with the cseq ``drgate promote``
printed, names exactly those 50 with their queue and records them as a
capture.  Two sites of three brokers and three sidecars (lab.site.TwoSites)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.site import TwoSites
from tests.gateway.test_promote import add_queues, drgate
from tests.lab import converged, metric, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]


def strand_and_promote(two: TwoSites) -> int:
    """Cut the WAN, publish 50 messages ``s-1`` .. ``s-50`` to P's q-full
    (spooled by every P sidecar: P does not know D is gone), promote D;
    the last P cseq D applied, as ``drgate promote`` printed it."""
    p = two.p
    two.wan_all("cut")
    stranded = p.client(1, "publish", p.amqp[1], "q-full", "--count", "50", "--prefix", "s")
    assert stranded["accepted"] == 50
    cseq = p.describe(1)["cseq"]
    for n in two.nodes:
        wait_for(
            f"P's sidecar {n} applied the 50",
            lambda n=n: (metric(two, "site-p", "drgate_bus_cseq", n) or 0) >= cseq,
        )
    promoted = drgate("promote", "--config", str(two.d.workdir / "sidecar-1.yaml"), "--json")
    assert promoted.returncode == 0, promoted.stderr
    after: int = json.loads(promoted.stdout)["applied_cseq"]
    return after


def test_the_divergent_tail_names_exactly_what_p_accepted_that_d_never_applied(
    tmp_path: Path,
) -> None:
    with TwoSites(workdir=tmp_path / "sites", metrics=True) as two:
        add_queues(two)
        p = two.p
        assert p.client(1, "publish", p.amqp[1], "q-full", "--count", "20")["accepted"] == 20
        wait_for("D's full replica equals P's queue", lambda: converged(two))
        after = strand_and_promote(two)

        out = tmp_path / "tail"
        done = drgate(
            "divergence", "--config", str(p.workdir / "sidecar-1.yaml"),
            "--after", str(after), "--out", str(out), "--json",
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        tail = json.loads(done.stdout)
        assert tail["missing"] == []
        assert list(tail["queues"]) == ["q-full"]
        assert tail["queues"]["q-full"]["message_ids"] == [f"s-{i}" for i in range(1, 51)]
        assert tail["capture"] and all(Path(c).exists() for c in tail["capture"])
        printed = drgate(
            "divergence", "--config", str(p.workdir / "sidecar-2.yaml"),
            "--after", str(after), "--out", str(tmp_path / "tail-2"),
        )  # fmt: skip
        assert "q-full: 50 published (s-1 .. s-50)" in printed.stdout, printed.stdout
