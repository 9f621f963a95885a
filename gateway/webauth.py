"""HTTP basic authentication for the observability endpoint, against argon2 hashes.

Theory of operation: an argon2 check costs tens of milliseconds of CPU and
64 MiB of memory by design, so it runs in a worker thread, one at a time
(``CHECK_LIMITER``), never on the trio thread.  A scraper sends the same
credentials every 15 s: once they have been verified, an HMAC of them under a
key drawn at start-up is remembered per user, and a later request with the
same credentials is checked against that in constant time, without argon2.
So a flood of wrong passwords costs one core at most and does not delay a
scraper whose credentials were seen before.  An unknown user is checked
against a configured hash all the same, so the answer's timing does not tell
which users exist.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os

import argon2
import trio

# One argon2 check at a time: it is memory-hard, and the process has one
# thread for everything else.
CHECKS_AT_ONCE = 1


def parse_basic(value: bytes | None) -> tuple[str, str] | None:
    """(user, password) of an ``Authorization: Basic ...`` header value, or
    None when it is missing or not valid basic credentials."""
    if value is None:
        return None
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


class BasicAuth:
    """Checks credentials against ``users`` (user -> argon2 hash), which is not empty."""

    def __init__(self, users: tuple[tuple[str, str], ...]) -> None:
        if not users:
            raise ValueError("BasicAuth needs at least one user")
        self.hashes = dict(users)
        self._decoy = users[0][1]
        self._hasher = argon2.PasswordHasher()
        self._key = os.urandom(32)
        self._seen: dict[str, bytes] = {}
        self._limiter = trio.CapacityLimiter(CHECKS_AT_ONCE)
        self.argon2_checks = 0  # how many times argon2 ran (tests read it)

    def _mac(self, user: str, password: str) -> bytes:
        message = user.encode() + b"\0" + password.encode()
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def _verify(self, hashed: str, password: str) -> bool:
        try:
            return self._hasher.verify(hashed, password)
        except argon2.exceptions.VerificationError:
            return False

    async def check(self, authorization: bytes | None) -> bool:
        """Whether the ``Authorization`` header value carries valid credentials."""
        credentials = parse_basic(authorization)
        if credentials is None:
            return False
        user, password = credentials
        mac = self._mac(user, password)
        seen = self._seen.get(user)
        if seen is not None and hmac.compare_digest(seen, mac):
            return True
        hashed = self.hashes.get(user)
        self.argon2_checks += 1
        ok = await trio.to_thread.run_sync(
            self._verify, hashed or self._decoy, password, limiter=self._limiter
        )
        ok = ok and hashed is not None
        if ok:
            self._seen[user] = mac
        return ok
