"""gateway.webauth: basic credentials against argon2 hashes, remembered once verified."""

from __future__ import annotations

import base64
import io

import argon2
import pytest

from gateway.cli import main
from gateway.webauth import BasicAuth, parse_basic
from tests.gateway.test_webconfig import FAST_HASHER


def basic(text: str) -> bytes:
    return b"Basic " + base64.b64encode(text.encode())


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (basic("u:p:q"), ("u", "p:q")),
        (b"basic " + base64.b64encode(b"u:"), ("u", "")),
        (basic("no-colon"), None),
        (b"Bearer abc", None),
        (b"Basic !!!", None),
        (None, None),
    ],
)
def test_parse_basic(value: bytes | None, expected: tuple[str, str] | None) -> None:
    assert parse_basic(value) == expected


async def test_verified_credentials_skip_argon2_and_others_do_not() -> None:
    auth = BasicAuth((("prometheus", FAST_HASHER.hash("s3cret")),))
    assert await auth.check(basic("prometheus:s3cret"))
    assert await auth.check(basic("prometheus:s3cret"))
    assert auth.argon2_checks == 1
    assert not await auth.check(basic("prometheus:wrong"))
    assert not await auth.check(basic("intruder:s3cret"))  # checked against a decoy hash
    assert not await auth.check(None)
    assert auth.argon2_checks == 3


def test_hash_password_prints_a_hash_the_web_config_accepts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("s3cret\n"))
    assert main(["hash-password"]) == 0
    hashed = capsys.readouterr().out.strip()
    assert argon2.PasswordHasher().verify(hashed, "s3cret")
