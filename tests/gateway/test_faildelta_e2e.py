"""A failback by delta (docs/operations.md, "Failback by delta"): the WAN is
cut, P accepts 50 messages D never gets, D is promoted and takes its own
publishes; then ``drgate failback --delta`` at D and at P records P's
divergent tail (exactly those 50), makes P D's DR site with a resync that
ships only what P lacks (bytes printed against a whole resync), and P ends
equal to D; a switchover at D then makes P the primary again.  Two sites of
three brokers and three sidecars with configs that link both ways
(lab.site.TwoSites, ``reversible``), on each bus."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lab.site import TwoSites
from tests.gateway import test_swap_e2e
from tests.gateway.test_divergence_e2e import strand_and_promote
from tests.gateway.test_promote import drgate
from tests.gateway.test_swap_e2e import replica, same, switch_over
from tests.lab import status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

two = test_swap_e2e.two  # the same two sites, linking both ways, on each bus
BODY = "2000"  # characters a message: most of the state, kept at P


def failback(*args: str) -> dict[str, Any]:
    done = drgate("failback", "--delta", *args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_old_primary_rejoins_by_delta_equal_to_d_and_a_switchover_makes_it_primary_again(
    two: TwoSites, tmp_path: Path
) -> None:
    p, d = two.p, two.d
    sent = p.client(1, "publish", p.amqp[1], "q-full", "--count", "400", "--size", BODY)
    assert sent["accepted"] == 400
    wait_for("D's full replica equals P's queue", lambda: same(p, d, "q-full"))
    after = strand_and_promote(two)
    assert (
        d.client(1, "publish", d.amqp[1], "q-full", "--count", "10", "--prefix", "d")["accepted"]
        == 10
    )
    two.wan_all("restore")

    adopted = failback("--config", str(d.workdir / "sidecar-1.yaml"))
    assert adopted["after"] == after
    rejoined = failback(
        "--config", str(p.workdir / "sidecar-1.yaml"),
        "--after", str(after), "--out", str(tmp_path / "tail"),
    )  # fmt: skip
    print("failback by delta:", {k: v for k, v in rejoined.items() if k != "steps"})  # -s
    assert rejoined["tail"]["published"] == {"q-full": 50}
    assert rejoined["tail"]["missing"] == []
    assert all(Path(c).exists() for c in rejoined["tail"]["capture"])
    assert rejoined["messages_kept"] == 400
    assert rejoined["bytes_shipped"] < rejoined["bytes_whole_resync"] / 10

    wait_for("P's q-full equals D's", lambda: same(p, d, "q-full"))
    assert replica(p, "q-full") == {"origin": "site-d", "mode": "full"}
    roles = {status(two, "site-d", n)["role"] for n in two.nodes}
    assert "egress" in roles
    assert "ingress" in {status(two, "site-p", n)["role"] for n in two.nodes}
    assert (
        d.client(1, "publish", d.amqp[1], "q-full", "--count", "5", "--prefix", "e")["accepted"]
        == 5
    )
    wait_for("D's next publishes reach P", lambda: same(p, d, "q-full"))

    back = switch_over(d.workdir / "sidecar-1.yaml")
    assert back["switched"]
    assert (
        p.client(1, "publish", p.amqp[1], "q-full", "--count", "5", "--prefix", "b")["accepted"]
        == 5
    )
    wait_for("P is the primary again and D its DR site", lambda: same(p, d, "q-full"))
    assert replica(d, "q-full") == {"origin": "site-p", "mode": "full"}
    assert status(two, "site-p", 1)["role"] == "egress"
