"""protocol/capturemanifest: the collected directory's manifest, strict both ways."""

from __future__ import annotations

import json

import pytest

from protocol.capturemanifest import (
    Manifest,
    ManifestSegment,
    Rejected,
    coverage,
    parse_manifest_untrusted,
)
from protocol.errors import RemoteProtocolError


def seg(
    file: str, node: int, stream: str, *, complete: bool = True, t: int = 10
) -> ManifestSegment:
    return ManifestSegment(
        file,
        f"/src/{file}",
        "site-p",
        node,
        stream,
        "egress",
        2**64 - 1,
        100,
        90 if not complete else 100,
        3,
        complete,
        t,
        t + 5,
    )


MANIFEST = Manifest(
    collected_at_us=123,
    sources=("/a", "/b"),
    segments=(seg("x/1.cap", 1, "forwarded"), seg("x/2.cap", 1, "forwarded", complete=False, t=2)),
    rejected=(Rejected("/b/bad.cap", ".rejected/0-bad.cap", "CRC32C mismatch"),),
)


def test_round_trip_and_coverage() -> None:
    assert parse_manifest_untrusted(MANIFEST.to_json()) == MANIFEST
    (c,) = coverage(MANIFEST)
    assert (c.segments, c.records, c.cut) == (2, 6, ["x/2.cap"])
    assert (c.first_time_us, c.last_time_us) == (2, 15)
    assert MANIFEST.segments[1].torn_bytes == 10


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="other"), "not a capture manifest"),
        (lambda d: d.update(version=2), "version 2"),
        (lambda d: d["segments"][0].update(node="1"), "'node' is '1', not int"),
        (lambda d: d["segments"][0].update(complete=1), "'complete' is 1, not bool"),
        (lambda d: d["segments"][0].update(records=True), "'records' is True, not int"),
        (lambda d: d["segments"][0].pop("stream"), "'stream' is None"),
        (lambda d: d.update(sources="/a"), "sources"),
    ],
)
def test_malformed_manifest_names_the_field(edit: object, message: str) -> None:
    doc = json.loads(MANIFEST.to_json())
    edit(doc)  # type: ignore[operator]
    with pytest.raises(RemoteProtocolError, match=message):
        parse_manifest_untrusted(json.dumps(doc))
    with pytest.raises(RemoteProtocolError, match="not JSON"):
        parse_manifest_untrusted(b"\xff{")
