"""A second AMQP 1.0 client against the broker: rhea, the Node.js client
(lab/rhea/client.js, installed by ``make test`` from the npm registry), beside
Proton's, on a site of three brokers (embedded bus).

What another client sees and Proton's tests did not show: every body shape
arrives whole on another broker of the site, the bare message and its
footer byte for byte (rhea's own footer, which it puts before the body, is
refused saying why); browsing (distribution-mode ``copy``) leaves the queue as it
was; a ``jms-selector`` delivers exactly the matching messages, and a bad one
is refused naming it; ``modified`` outcomes count deliveries and merge
annotations; a message whose consumer died comes back with its count raised.
That the same bytes reach site D is tests/gateway/test_passthrough_e2e.py.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from lab.site import ROOT, BrokerSite

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.interop]

CLIENT = ROOT / "lab" / "rhea" / "client.js"
RHEA = ROOT / "lab" / "rhea" / "node_modules" / "rhea"
TIMEOUT_S = 60.0
_queues = itertools.count(1)


def require_rhea() -> None:
    """Skip (locally) or fail (in CI) when node or rhea is missing."""
    reason = None
    if shutil.which("node") is None:
        reason = "node is not installed (apt-get install nodejs)"
    elif not RHEA.is_dir():
        reason = "rhea is not installed (make test installs it: cd lab/rhea && npm ci)"
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the interop suite must run in CI: {reason}")
        pytest.skip(reason)


def rhea(*args: str) -> dict[str, Any]:
    """Run the rhea client; its JSON result."""
    done = subprocess.run(
        ["node", str(CLIENT), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    try:
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise AssertionError(f"rhea client {args} failed: {done.stderr[-2000:]}") from None
    return result


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerSite]:
    require_rhea()
    with BrokerSite("site-p", nodes=3, workdir=tmp_path_factory.mktemp("site")) as s:
        yield s


@pytest.fixture
def queue(site: BrokerSite) -> str:
    """A new queue of the site, for one test."""
    name = f"interop-{next(_queues)}"
    done = site.admin(1, "add-queue", name)
    assert done.returncode == 0, done.stderr
    return name


def send(site: BrokerSite, queue: str, *args: str, node: int = 1) -> dict[str, Any]:
    return rhea("send", site.amqp[node], queue, *args)


def receive(site: BrokerSite, queue: str, *args: str, node: int = 3) -> dict[str, Any]:
    return rhea("receive", site.amqp[node], queue, "--idle", "1.5", *args)


# ---------------------------------------------------------------------------
# The message as sent
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ("multi-data", {"kind": "data", "sections": 2, "content": ["first-1", "second-1"]}),
        ("sequences", {"kind": "sequence", "sections": 2, "content": [[1, "a"], [2, "b"]]}),
        ("null-value", {"kind": "value", "value": None}),
    ],
)
def test_every_body_shape_arrives_whole_on_another_broker(
    site: BrokerSite, queue: str, shape: str, expected: dict[str, Any]
) -> None:
    assert send(site, queue, "--shape", shape)["accepted"] == 1
    got = receive(site, queue, "--count", "1")
    assert got["error"] is None, got
    assert [m["body"] for m in got["messages"]] == [expected]


def test_rheas_footer_before_the_body_is_refused_naming_the_byte(
    site: BrokerSite, queue: str
) -> None:
    # rhea 3.0.5 encodes a footer before the body section (AMQP puts it
    # last): the broker refuses the message, saying where, rather than store
    # what other clients could not read.  A footer in its place passes
    # through byte for byte (the next test).
    sent = send(site, queue, "--shape", "footer")
    assert (sent["accepted"], sent["rejected"]) == (0, 1)
    (error,) = sent["errors"]
    assert error["condition"] == "amqp:decode-error"
    assert "section data out of order" in error["description"]


def section(code: int, value: bytes) -> bytes:
    """A described section: descriptor 0x00 smallulong ``code``, then the value."""
    return bytes([0x00, 0x53, code]) + value


def str8(text: str) -> bytes:
    raw = text.encode()
    return bytes([0xA1, len(raw)]) + raw


def sym8(text: str) -> bytes:
    raw = text.encode()
    return bytes([0xA3, len(raw)]) + raw


def compound32(code: int, items: list[bytes]) -> bytes:
    """A list32 (0xd0) or map32 (0xd1): size and count on four bytes each,
    where a client would have used the one-byte forms."""
    body = b"".join(items)
    return bytes([code]) + struct.pack(">II", len(body) + 4, len(items)) + body


def bare_message() -> bytes:
    """Properties (list32, message-id only), application-properties (map32),
    two data sections and a footer: the bytes a signature would cover."""
    return b"".join(
        [
            section(0x73, compound32(0xD0, [str8("raw-1")])),
            section(0x74, compound32(0xD1, [str8("color"), str8("red")])),
            section(0x75, bytes([0xA0, 5]) + b"first"),
            section(0x75, bytes([0xA0, 6]) + b"second"),
            section(0x78, compound32(0xD1, [sym8("x-checksum"), str8("abc")])),
        ]
    )


def test_the_bare_message_arrives_byte_for_byte_on_another_broker(
    site: BrokerSite, queue: str
) -> None:
    sent = bare_message()
    assert send(site, queue, "--raw", sent.hex())["accepted"] == 1
    got = site.client(3, "consume", site.amqp[3], queue, "--count", "1", "--raw")
    (payload,) = [bytes.fromhex(p) for p in got["payloads"]]
    assert payload.endswith(sent), f"sent {sent.hex()}\ngot  {payload.hex()}"
    prefix = payload[: len(payload) - len(sent)]
    assert prefix[:3] in (b"", b"\x00\x53\x70", b"\x00\x53\x71", b"\x00\x53\x72"), prefix.hex()


# ---------------------------------------------------------------------------
# Browse and selectors
# ---------------------------------------------------------------------------


def test_browsing_leaves_the_queue_untouched(site: BrokerSite, queue: str) -> None:
    assert send(site, queue, "--count", "3")["accepted"] == 3
    browsed = receive(site, queue, "--browse")
    assert browsed["attach"]["distribution_mode"] == "copy"
    assert [m["id"] for m in browsed["messages"]] == ["m-1", "m-2", "m-3"]
    consumed = receive(site, queue, node=2)
    assert [m["id"] for m in consumed["messages"]] == ["m-1", "m-2", "m-3"]


def test_a_selector_delivers_exactly_the_matching_messages(site: BrokerSite, queue: str) -> None:
    send(site, queue, "--count", "2", "--prefix", "red", "--prop", "color=red")
    send(site, queue, "--count", "2", "--prefix", "blue", "--prop", "color=blue")
    red = receive(site, queue, "--selector", "color = 'red' AND seq IN (1, 2)")
    assert red["attach"]["filter"] == ["jms-selector"]
    assert [m["id"] for m in red["messages"]] == ["red-1", "red-2"]
    rest = receive(site, queue, node=2)
    assert [m["id"] for m in rest["messages"]] == ["blue-1", "blue-2"]


def test_a_malformed_selector_is_refused_naming_it(site: BrokerSite, queue: str) -> None:
    got = receive(site, queue, "--selector", "color = ")
    assert got["error"] is not None, got
    assert got["error"]["condition"] == "amqp:invalid-field"
    assert "selector 'color ='" in got["error"]["description"]
    assert "at position" in got["error"]["description"]


# ---------------------------------------------------------------------------
# Outcomes
# ---------------------------------------------------------------------------


def test_two_delivery_failures_count_two(site: BrokerSite, queue: str) -> None:
    send(site, queue)
    for _ in range(2):
        assert len(receive(site, queue, "--count", "1", "--outcome", "failed")["messages"]) == 1
    (message,) = receive(site, queue, "--count", "1", node=1)["messages"]
    assert message["delivery_count"] == 2


def test_a_message_whose_consumer_died_comes_back_counted(site: BrokerSite, queue: str) -> None:
    send(site, queue)
    held = receive(site, queue, "--count", "1", "--outcome", "none")
    assert len(held["messages"]) == 1  # closed unsettled: the consumer is gone
    (message,) = receive(site, queue, "--count", "1", node=2)["messages"]
    assert message["delivery_count"] == 1


def test_undeliverable_here_is_not_redelivered_to_that_link(site: BrokerSite, queue: str) -> None:
    send(site, queue)
    # Room for two: the second would be the same message again on that link.
    refused = receive(site, queue, "--count", "2", "--outcome", "undeliverable")
    assert [m["id"] for m in refused["messages"]] == ["m-1"]
    (message,) = receive(site, queue, "--count", "1", node=2)["messages"]
    assert message["id"] == "m-1" and message["delivery_count"] == 1


def test_modified_annotations_are_merged(site: BrokerSite, queue: str) -> None:
    send(site, queue)
    receive(site, queue, "--count", "1", "--outcome", "annotated")
    (message,) = receive(site, queue, "--count", "1", node=2)["messages"]
    assert message["annotations"].get("x-drgate-note") == "seen"
