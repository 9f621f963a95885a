"""Damaged journals and a broker gone for good, end to end, on one durable
site of three brokers (lab.site.BrokerSite, ``durable=True``, embedded bus):

* a torn tail (a record cut short) after a kill -9 of the whole site is cut
  and the site recovers everything it settled;
* a flipped byte in the middle of a segment stops that broker naming the file
  and offset; ``drgate journal reseed`` and it starts, takes the site's
  state from its peers;
* a broker whose journal is gone never reports: the others wait, and
  ``drgate recover --force`` continues from those that reported.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.site import BrokerSite, SiteError
from protocol import journal as pj
from tests.lab import queues, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

QUEUE = "orders"
COUNT = 300


@pytest.fixture
def site(tmp_path: Path) -> Iterator[BrokerSite]:
    with BrokerSite("site-p", workdir=tmp_path, durable=True) as started:
        done = started.admin(1, "add-queue", QUEUE, "--durable")
        assert done.returncode == 0, done.stderr
        yield started


def publish(site: BrokerSite, node: int, count: int = COUNT) -> None:
    got = site.client(node, "publish", site.amqp[node], QUEUE, "--count", str(count), "--durable")
    assert got["accepted"] == count, got


def depth(site: BrokerSite, node: int) -> int:
    described = queues(site.describe(node)).get(QUEUE, {})
    return int(described.get("depth", 0))


def kill_site(site: BrokerSite) -> None:
    for name in [f"broker-{n}" for n in site.node_ids] + ["bus"]:
        site.kill(name, signal.SIGKILL)


def records(segment: Path) -> list[tuple[int, int]]:
    """(offset, end) of every record of ``segment``."""
    data = segment.read_bytes()
    found, at = [], pj.SEGMENT_HEADER_SIZE
    while at < len(data):
        end = pj.next_record_untrusted(data, at).end
        found.append((at, end))
        at = end
    return found


def last_segment(site: BrokerSite, node: int) -> Path:
    return sorted((site.workdir / f"journal-{node}").glob("journal-*.log"))[-1]


def journal_sizes(site: BrokerSite) -> list[int]:
    return [last_segment(site, n).stat().st_size for n in site.node_ids]


def log_of(site: BrokerSite, node: int) -> str:
    return (site.workdir / f"broker-{node}.log").read_text()


def test_a_torn_tail_after_the_whole_site_was_killed_is_cut_and_nothing_settled_is_lost(
    site: BrokerSite,
) -> None:
    publish(site, 1)
    # Every broker wrote the same stream (so another holds broker 1's last record).
    wait_for("the brokers' journals are alike", lambda: len(set(journal_sizes(site))) == 1)
    kill_site(site)
    segment = last_segment(site, 1)
    offset, end = records(segment)[-1]
    with segment.open("r+b") as f:
        f.truncate(offset + (end - offset) // 2)  # the last record, cut mid-way

    site.start()
    assert f"truncated=torn-tail file={segment} offset={offset}" in log_of(site, 1)
    wait_for("the site recovered", lambda: depth(site, 2) == COUNT, timeout=60)
    got = site.client(1, "consume", site.amqp[1], QUEUE, "--idle", "3", "--credit", "500")
    assert got["ids"] == [f"m-{i}" for i in range(1, COUNT + 1)]


def test_a_flipped_byte_stops_the_broker_and_journal_reseed_lets_it_rejoin(
    site: BrokerSite,
) -> None:
    publish(site, 1)
    wait_for("broker 3 holds the messages", lambda: depth(site, 3) == COUNT)
    site.kill("broker-3", signal.SIGTERM)
    segment = last_segment(site, 3)
    middle = records(segment)
    offset, end = middle[len(middle) // 2]
    data = bytearray(segment.read_bytes())
    data[offset + pj.RECORD_HEADER_SIZE + (end - offset - pj.RECORD_HEADER_SIZE) // 2] ^= 0x20
    segment.write_bytes(bytes(data))

    with pytest.raises(SiteError, match="exited with 1"):
        site.start_broker(3)
    wait_for(
        "broker 3's log names the file, the offset and the command",
        lambda: (
            f"{segment}: byte offset {offset}: CRC mismatch" in log_of(site, 3)
            and "drgate journal reseed --config" in log_of(site, 3)
        ),
    )

    config = str(site.workdir / "broker-3.yaml")
    checked = site.drgate(3, "journal", "check", "--config", config)
    assert checked.returncode == 1 and f"byte offset {offset}" in checked.stdout
    reseeded = site.drgate(3, "journal", "reseed", "--config", config)
    assert reseeded.returncode == 0, reseeded.stderr
    assert "takes the state from its peers" in reseeded.stdout
    assert len(list(site.workdir.glob("journal-3.damaged-*"))) == 1

    publish(site, 1, 20)  # the site goes on meanwhile
    site.start_broker(3)
    wait_for("broker 3 holds the site's state", lambda: depth(site, 3) == COUNT + 20)


def test_a_broker_gone_for_good_is_left_behind_by_recover_force(site: BrokerSite) -> None:
    publish(site, 1)
    wait_for("broker 2 holds the messages", lambda: depth(site, 2) == COUNT)
    kill_site(site)
    shutil.rmtree(site.workdir / "journal-3")  # its disk is gone; node 3 stays down

    site.start_bus()
    for node in (1, 2):
        site.start_broker(node)
    config = str(site.workdir / "broker-1.yaml")
    shown = site.drgate(1, "recover", "--config", config)
    assert shown.returncode == 0, shown.stderr
    assert "waits for its brokers' journals: 2 of 3 brokers reported" in shown.stdout
    wait_for(
        "the brokers' logs name the command",
        lambda: "drgate recover --force" in log_of(site, 1),
    )
    assert depth(site, 1) == 0  # recovering: the site serves nothing yet

    forced = site.drgate(1, "recover", "--force", "--config", config)
    assert forced.returncode == 0, forced.stderr
    assert "site site-p is live" in forced.stdout
    assert "drgate resync --accept-incarnation" in forced.stdout  # node 3 may have had more
    wait_for("the site recovered", lambda: depth(site, 2) == COUNT)
    publish(site, 2, 20)
    site.start_broker(3)  # back with an empty disk: it joins the live site
    wait_for("broker 3 holds the site's state", lambda: depth(site, 3) == COUNT + 20)
