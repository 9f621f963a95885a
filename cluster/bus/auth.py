"""The embedded bus's authentication: the site key file and the handshake proofs.

Membership of a site's bus is the authentication (docs/architecture.md,
section 12): a member proves it holds the site's secret key before the
sequencer delivers it anything or takes anything from it, and the sequencer
proves it holds the same key before the member trusts its stream.

Theory of operation
-------------------
The key is a file of at least :data:`KEY_MIN_BYTES` random bytes that only
its owner may read (mode 0400 or 0600), made by ``drgate keygen --bus``; the
sequencer and every member of the site read the same file.  The handshake
(cluster/bus/embedded.py carries it) is a challenge-response in both
directions over the *transcript*: the member's HELLO body (its node, pid,
role, a fresh member nonce and the group) followed by a fresh sequencer
nonce.  The member answers with ``HMAC-SHA256(key, MEMBER_LABEL + transcript)``;
the sequencer, once that matched, with ``HMAC-SHA256(key, SEQUENCER_LABEL +
transcript + its WELCOME ids)``.  Both nonces are fresh, so no proof can be
replayed on another connection; the two labels differ, so one side's proof is
never the other's (no reflection); the key never crosses the wire; proofs are
compared in constant time.  The proofs authenticate the peers, not the
stream after them: the bus carries its frames in clear on loopback or a
host's own network, as corosync's IPC does.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from protocol.errors import BusError

# 256 bits: HMAC-SHA256's strength; a longer key adds nothing to it.
KEY_MIN_BYTES = 32
# What `drgate keygen --bus` writes.
KEY_BYTES = 32
# A key file larger than this is not a key (a wrong path, most likely).
KEY_MAX_BYTES = 4096
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
MEMBER_LABEL = b"drgate bus member proof\x00"
SEQUENCER_LABEL = b"drgate bus sequencer proof\x00"
KEYGEN_HINT = "make one with `drgate keygen --bus PATH` and give every member of the site a copy"


class BusKeyError(BusError):
    """A bus key file cannot be used: ``problem`` says why, ``fix`` what to do."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix


def read_key_file(path: str) -> bytes:
    """The key in ``path``: a regular file of ``KEY_MIN_BYTES`` to
    ``KEY_MAX_BYTES`` bytes with no permission for group or others.
    Raises :class:`BusKeyError` naming the file and the fix."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise BusKeyError(
            f"cannot read the bus key file {path} ({exc.strerror})", KEYGEN_HINT
        ) from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BusKeyError(f"the bus key file {path} is not a regular file", KEYGEN_HINT)
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise BusKeyError(
                f"the bus key file {path} has mode {mode:04o}: group or others may read "
                "or change the site's key",
                f"run `chmod 0400 {path}` (and keep it owned by the user drgate runs as)",
            )
        key = file.read(KEY_MAX_BYTES + 1)
    if not KEY_MIN_BYTES <= len(key) <= KEY_MAX_BYTES:
        raise BusKeyError(
            f"the bus key file {path} holds {len(key)} bytes, not {KEY_MIN_BYTES} to "
            f"{KEY_MAX_BYTES}",
            KEYGEN_HINT,
        )
    return key


def bus_key_problem(backend: str, key_file: str | None) -> tuple[str, str] | None:
    """What is wrong with a bus config's ``key_file`` for ``backend``, as
    (problem, fix), or None: the embedded bus needs a key it can read, and
    corosync takes none (its nodes authenticate with corosync's authkey)."""
    if backend == "corosync" and key_file is not None:
        return (
            "'bus.key_file' is for the embedded bus; corosync authenticates the site's nodes "
            "with its own authkey",
            "remove key_file and name the authkey in corosync.conf (totem.keyfile; docs/bus.md)",
        )
    if backend != "embedded":
        return None
    if key_file is None:
        return (
            "the embedded bus needs 'key_file' (the site's bus key: members that do not "
            "hold it are refused)",
            "make one with 'drgate keygen --bus bus.key', give the sequencer "
            "'--key-file bus.key' and add key_file: bus.key",
        )
    try:
        read_key_file(key_file)
    except BusKeyError as exc:
        return exc.problem, exc.fix
    return None


def write_key_file(path: str) -> None:
    """Write a new key (``KEY_BYTES`` random bytes, mode 0400) to ``path``.
    Raises :class:`BusKeyError` when ``path`` exists (a site's key is never
    replaced by accident) or cannot be created."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400)
    except FileExistsError:
        raise BusKeyError(
            f"{path} exists",
            "a site has one key: copy that file to the site's other hosts, or remove it "
            "first to make a new one (then every member of the site needs the new key)",
        ) from None
    except OSError as exc:
        raise BusKeyError(
            f"cannot create the bus key file {path} ({exc.strerror})",
            "give a path in a folder that exists and that you may write to",
        ) from None
    with os.fdopen(fd, "wb") as file:
        file.write(secrets.token_bytes(KEY_BYTES))


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def member_proof(key: bytes, transcript: bytes) -> bytes:
    """What a member sends to prove it holds ``key``."""
    return hmac.new(key, MEMBER_LABEL + transcript, hashlib.sha256).digest()


def sequencer_proof(key: bytes, transcript: bytes) -> bytes:
    """What the sequencer sends to prove it holds ``key``."""
    return hmac.new(key, SEQUENCER_LABEL + transcript, hashlib.sha256).digest()


def proof_matches(expected: bytes, received: bytes) -> bool:
    """Constant-time comparison: how long it takes says nothing of the key."""
    return hmac.compare_digest(expected, received)
