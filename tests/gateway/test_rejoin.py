"""One broker of a durable site killed -9 and restarted while the others run
takes only the delta: the donor leaves the bodies its journal holds out of
the state transfer (lab.site.BrokerSite, ``durable=True``, embedded bus;
docs/broker.md "Durability")."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.site import BrokerSite
from tests.lab import queues, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

QUEUE = "orders"
DELTA = re.compile(r"state transfer to \S+: delta of (\d+) bytes, (\d+) bodies left to its journal")


@pytest.fixture
def site(tmp_path: Path) -> Iterator[BrokerSite]:
    with BrokerSite("site-p", workdir=tmp_path, durable=True) as started:
        done = started.admin(1, "add-queue", QUEUE, "--durable")
        assert done.returncode == 0, done.stderr
        yield started


def publish(site: BrokerSite, node: int, count: int) -> None:
    got = site.client(node, "publish", site.amqp[node], QUEUE, "--count", str(count), "--durable")
    assert got["accepted"] == count, got


def equal(site: BrokerSite) -> bool:
    first = queues(site.describe(site.node_ids[0]))
    return all(queues(site.describe(n)) == first for n in site.node_ids)


def test_a_broker_killed_and_restarted_takes_the_delta_and_ends_equal(site: BrokerSite) -> None:
    publish(site, 1, 500)
    wait_for("the restarted broker's queues equal the others'", lambda: equal(site))
    last = site.node_ids[-1]
    site.kill(f"broker-{last}", signal.SIGKILL)
    publish(site, 1, 100)
    site.start_broker(last)
    wait_for("the restarted broker's queues equal the others'", lambda: equal(site))
    assert queues(site.describe(last))[QUEUE]["depth"] == 600
    donor_log = (site.workdir / "broker-1.log").read_text()
    left = [int(m.group(2)) for m in DELTA.finditer(donor_log)]
    assert max(left) == 500, donor_log[-2000:]
