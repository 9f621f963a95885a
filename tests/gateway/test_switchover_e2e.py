"""A planned switchover end to end (docs/operations.md, "A planned
switchover"): ``drgate switchover`` at P while a publisher runs; every
message P accepted is at D (RPO 0), the rest were refused naming the
switchover, D is the primary and P handed over without a split brain.

Two sites of three brokers and three sidecars (lab.site.TwoSites).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.site import TwoSites
from tests.gateway.test_promote import add_queues, drgate
from tests.lab import converged, queues, status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoSites]:
    with TwoSites(workdir=tmp_path, metrics=True) as sites:
        add_queues(sites)
        yield sites


def outcomes(record: Path) -> list[str]:
    """The publisher's outcomes so far, in order (its --record file)."""
    if not record.exists():
        return []
    lines = record.read_text().splitlines()
    return [json.loads(line)["outcome"] for line in lines if line.endswith("}")]


def test_a_switchover_that_cannot_drain_aborts_then_one_under_load_hands_the_role_to_d(
    two: TwoSites,
) -> None:
    """One pair of sites for both (a site pair costs a minute of CI): first a
    switchover with the WAN cut, which cannot drain and must leave P
    writable; then, the WAN back, one under load, which must lose nothing."""
    assert two.p.client(1, "publish", two.p.amqp[1], "q-full", "--count", "49")["accepted"] == 49
    wait_for("D's full replica equals P's queue", lambda: converged(two))
    two.wan_all("cut")  # nothing can drain
    done = drgate("switchover", "--config", str(two.p.workdir / "sidecar-1.yaml"), "--timeout", "3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "abort" in done.stdout and "take publishes again" in done.stdout
    assert (
        two.p.client(1, "publish", two.p.amqp[1], "q-full", "--count", "1", "--start", "50")[
            "accepted"
        ]
        == 1
    )
    two.wan_all("restore")
    wait_for("D's full replica equals P's queue", lambda: converged(two))

    record = two.p.workdir / "publisher.jsonl"
    publisher = two.p.client_popen(
        1, "publish", two.p.amqp[1], "q-full", "--count", "100000", "--rate", "100",
        "--start", "51", "--record", str(record),
    )  # fmt: skip
    wait_for("the publisher is under way", lambda: len(outcomes(record)) > 100)

    done = drgate("switchover", "--config", str(two.p.workdir / "sidecar-1.yaml"), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    print("switchover:", {k: result[k] for k in ("window_seconds", "drained_cseqs")})  # -s
    assert result["switched"] and result["to"] == "site-d"
    assert result["handover_cseq"] > result["quiesced_cseq"]
    assert "q-full" in result["guarded_queues"] and "q-wire" not in result["guarded_queues"]
    assert [s["step"] for s in result["steps"]] == ["quiesce", "drain", "drain", "handover", "done"]
    # The publisher runs on past the switch: refused from the quiesce on.
    wait_for("publishes are refused", lambda: outcomes(record).count("rejected") >= 20)
    publisher.kill()
    publisher.communicate()
    seen = outcomes(record)
    accepted = seen.count("accepted")
    assert "accepted" not in seen[seen.index("rejected") :]  # none after the first refusal

    # RPO 0: D holds exactly what P accepted, in P's order.
    p_full, d_full = queues(two.p.describe(2))["q-full"], queues(two.d.describe(2))["q-full"]
    assert p_full["depth"] == 50 + accepted
    assert d_full["depth"] == p_full["depth"] and d_full["digest"] == p_full["digest"]

    # D is the primary: its full replica takes publishes; P's stays closed.
    assert two.d.client(1, "publish", two.d.amqp[1], "q-full", "--count", "1")["accepted"] == 1
    late = two.p.client(1, "publish", two.p.amqp[1], "q-full", "--count", "1")
    assert late["accepted"] == 0 and "site-d" in late["first_rejection"]
    # P handed over: its egress does not knock, and D reports no split brain.
    p_status = status(two, "site-p", 1)
    assert p_status["link_state"] == "refused"
    assert "handed over to site-d" in p_status["last_error"]
    assert not any(status(two, "site-d", n)["partitioned"] for n in two.nodes)
    assert status(two, "site-d", 1)["resync"]["promoted"]
    assert p_status["superseded_by"] == "site-d"

    # Switch back by a failback, the WAN cut so that D cannot be resynced yet:
    # P takes publishes at once, but its consumers wait until D holds P's
    # state again; otherwise an enqueue message taken here before the
    # resync's cut would never reach D.
    two.wan_all("cut")
    accepted = drgate("failback", "--config", str(two.d.workdir / "sidecar-1.yaml"), "--json")
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    epoch = json.loads(accepted.stdout)["epoch"]
    p_config = str(two.p.workdir / "sidecar-1.yaml")
    resumed = drgate("failback", "--config", p_config, "--epoch", str(epoch))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    new = two.p.client(1, "publish", two.p.amqp[1], "q-enq", "--count", "5", "--prefix", "back")
    assert new["accepted"] == 5, new
    early = two.p.client(1, "consume", two.p.amqp[1], "q-enq", "--count", "5", "--idle", "5")
    assert early["received"] == 0, early
    assert "cannot be consumed from until the DR site holds site-p" in early["error"]
    two.wan_all("restore")
    wait_for(
        "D's enqueue replica has what P took after the failback",
        lambda: queues(two.d.describe(2)).get("q-enq", {}).get("depth", 0) == 5,
    )
    # D holding the messages is not yet P knowing it: the wait ends when D's
    # acknowledgement of the failback's point is applied at P (its /status
    # shows it), and a consumer refused before that tries again.
    wait_for(
        "P learned that D holds the failback's point",
        lambda: status(two, "site-p", 1)["failback_wait_cseq"] == 0,
    )
    taken: list[str] = []

    def consume_the_rest() -> bool:
        late = two.p.client(
            1, "consume", two.p.amqp[1], "q-enq", "--count", str(5 - len(taken)), "--idle", "5"
        )
        assert not late["error"] or "until the DR site holds site-p" in late["error"], late
        taken.extend(late["ids"])
        return len(taken) == 5

    wait_for("P's consumer took the 5 messages", consume_the_rest)
    assert sorted(taken) == [f"back-{n}" for n in range(1, 6)]
