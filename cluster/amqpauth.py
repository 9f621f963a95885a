"""Who an AMQP client is and what it may do: SASL, the users file, rights by queue pattern.

Theory of operation
-------------------
Proton's built-in SASL (without Cyrus) cannot check a password on the server
side, and TLS ends outside Proton (``trio.SSLStream``), so the broker runs
the SASL exchange itself, before a byte reaches Proton's engine
(AMQP 1.0 part 5.3): the client's SASL protocol header, our header and
``sasl-mechanisms``, the client's ``sasl-init``, our ``sasl-outcome``.
What follows (the client's AMQP header, often pipelined) goes to a Proton
transport without a SASL layer.  A client that skips SASL and sends the AMQP
header at once is taken as ``EXTERNAL`` under TLS, or ``ANONYMOUS`` where
that is allowed; otherwise it gets the SASL header back and the socket
closes, which is what the specification asks of a server that requires SASL.

Mechanisms offered (:meth:`Authenticator.mechanisms`):

* ``EXTERNAL`` under TLS: the identity is the client certificate's subject
  commonName (else its first subjectAltName), or what ``identities`` maps
  it to.
* ``PLAIN`` when a users file is configured, over TLS, on a loopback
  listener, or with ``allow_plaintext`` (the operator's explicit opt-out).
* ``ANONYMOUS`` when ``allow_anonymous`` (the default only on a loopback
  listener without a users file).

Rights (:class:`Principal`): without a users file every authenticated client
may do everything (the "open" mode of a loopback test broker).  With one,
a client is the user of that name: it may publish to (consume from) queues
matching its ``publish`` (``consume``) globs (:func:`fnmatch.fnmatchcase`),
and only an ``admin`` may use ``$drgate.admin`` and ``$drgate.queues``.

Users file: JSON, written by ``drgate admin user add`` (0600, replaced
atomically)::

    {"version": 1, "users": {"alice": {"hash": "$argon2id$...", "admin": false,
                                       "publish": ["orders.*"], "consume": ["orders.*"]}}}
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import ipaddress
import json
import logging
import os
import ssl
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import proton
import trio
from proton import Data

from protocol.errors import ConfigError, Location, Problem, RemoteProtocolError

__all__ = [
    "AMQP_HEADER",
    "ANONYMOUS",
    "DEFAULT_MAX_CONNECTIONS",
    "OPEN_RIGHTS",
    "PLAINTEXT_WARNING",
    "SASL_HEADER",
    "AmqpSecurity",
    "Authenticator",
    "Principal",
    "User",
    "authenticate_untrusted",
    "certificate_identity",
    "connection_cap_refusal",
    "is_loopback",
    "listener_problems",
    "load_users",
    "save_users",
]

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
# Protocol headers (AMQP 1.0 part 2.2): "AMQP", protocol id, major, minor, revision.
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
# A frame header: size (u32, the header included), data offset in 4-byte
# words (u8, 2), type (u8, 1 = SASL), channel (u16, ignored for SASL).
SASL_FRAME = struct.Struct(">IBBH")
SASL_FRAME_TYPE = 1
# The spec's minimum max-frame-size during SASL is 512; a sasl-init carries a
# user name and a password, so a few KiB is plenty and bounds what we buffer.
MAX_SASL_FRAME = 8 * 1024
# Descriptors of the SASL performatives we send and read.
SASL_MECHANISMS = 0x40
SASL_INIT = 0x41
SASL_OUTCOME = 0x44
# sasl-code: 0 ok, 1 auth (bad credentials).
SASL_OK = 0
SASL_AUTH = 1
# Connections one node serves at once: far above what a site's clients
# need, far below the file descriptors and memory that would take a node down.
DEFAULT_MAX_CONNECTIONS = 1000
USERS_FILE_VERSION = 1
REWRITE = "rewrite it with 'drgate admin user add NAME --file PATH'"
# A TLS handshake and SASL exchange that take longer than this are abandoned.
HANDSHAKE_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------
# Users and rights
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class User:
    """One entry of the users file: an argon2 hash and the rights."""

    name: str
    password_hash: str
    admin: bool = False
    publish: tuple[str, ...] = ()
    consume: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated client and its rights (see the module docstring)."""

    name: str
    admin: bool = False
    publish: tuple[str, ...] = ()
    consume: tuple[str, ...] = ()
    mechanism: str = ""

    def may_publish(self, address: str) -> bool:
        return self.admin or any(fnmatch.fnmatchcase(address, p) for p in self.publish)

    def may_consume(self, address: str) -> bool:
        return self.admin or any(fnmatch.fnmatchcase(address, p) for p in self.consume)


# What every client may do when no users file is configured.
OPEN_RIGHTS = Principal(ANONYMOUS, admin=True, publish=("*",), consume=("*",))


@dataclasses.dataclass(frozen=True, slots=True)
class AmqpSecurity:
    """The broker's ``amqp`` security settings (gateway/config.py builds them).

    ``users``: the users file as loaded (``None``: open mode);
    ``allow_anonymous``: ``None`` means the default (allowed only on a
    loopback listener without a users file); ``identities``: certificate
    name -> user name.
    """

    users: Mapping[str, User] | None = None
    users_file: str = ""
    allow_anonymous: bool | None = None
    allow_plaintext: bool = False
    identities: Mapping[str, str] = dataclasses.field(default_factory=dict)
    max_connections: int = DEFAULT_MAX_CONNECTIONS


def is_loopback(host: str) -> bool:
    """``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


PLAINTEXT_WARNING = (
    "not loopback and no TLS (amqp.allow_plaintext): passwords and messages cross the "
    "network in clear"
)


def connection_cap_refusal(max_connections: int) -> tuple[str, str]:
    """The error (condition, description) of a connection beyond the cap."""
    return (
        "amqp:resource-limit-exceeded",
        f"this broker node serves at most {max_connections} connections; retry later or "
        "use another node of the site (the limit is 'amqp.max_connections' in its config)",
    )


def listener_problems(host: str, *, tls: bool, security: AmqpSecurity) -> list[tuple[str, str]]:
    """``(problem, fix)`` for a listener on ``host`` that would be open to the
    network without the operator saying so; empty when it is fine."""
    if is_loopback(host):
        return []
    problems = []
    if not tls and not security.allow_plaintext:
        problems.append(
            (
                f"'amqp.listen' binds {host}, not a loopback address, without 'amqp.tls': "
                "passwords and messages would cross the network in clear",
                "add 'amqp.tls', or set 'amqp.allow_plaintext: true' to accept that "
                "(a warning is logged at start), or listen on 127.0.0.1",
            )
        )
    if security.users is None and not security.allow_anonymous:
        problems.append(
            (
                f"'amqp.listen' binds {host}, not a loopback address, without 'amqp.users': "
                "every client could delete and purge any queue",
                "add 'amqp.users: users.json' (drgate admin user add NAME --admin --file "
                "users.json), or set 'amqp.allow_anonymous: true' to accept that",
            )
        )
    return problems


def load_users(path: str) -> dict[str, User]:
    """The users file at ``path``; :class:`ConfigError` naming the file, the
    entry and the fix when it cannot be read or is malformed."""
    where = Location(path, 1, 1)

    def fail(problem: str, fix: str) -> ConfigError:
        return ConfigError([Problem(where, problem, fix)])

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise fail(
            f"cannot read the users file: {exc.strerror}",
            "create it with 'drgate admin user add NAME --file PATH'",
        ) from exc
    except ValueError as exc:
        raise fail(f"the users file is not JSON: {exc}", REWRITE) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("users"), dict):
        raise fail("the users file has no 'users' mapping", REWRITE)
    users = {}
    for name, entry in doc["users"].items():
        try:
            users[name] = _user_of(name, entry)
        except (TypeError, KeyError) as exc:
            raise fail(
                f"user {name!r} is malformed ({exc})",
                f"set it again with 'drgate admin user add {name} --file {path}'",
            ) from exc
    return users


def _user_of(name: str, entry: Any) -> User:
    if not isinstance(entry, dict) or not isinstance(entry["hash"], str):
        raise TypeError("needs a 'hash' text")
    patterns = {k: entry.get(k, []) for k in ("publish", "consume")}
    for key, value in patterns.items():
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise TypeError(f"'{key}' must be a list of glob patterns")
    return User(
        name,
        entry["hash"],
        admin=entry.get("admin") is True,
        publish=tuple(patterns["publish"]),
        consume=tuple(patterns["consume"]),
    )


def save_users(path: str, users: Mapping[str, User]) -> None:
    """Write ``users`` to ``path`` atomically (a temporary file in the same
    folder, fsynced, renamed over it), readable by its owner only (0600)."""
    doc = {
        "version": USERS_FILE_VERSION,
        "users": {
            u.name: {
                "hash": u.password_hash,
                "admin": u.admin,
                "publish": list(u.publish),
                "consume": list(u.consume),
            }
            for u in sorted(users.values(), key=lambda u: u.name)
        },
    }
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(doc, out, indent=2)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def certificate_identity(cert: Mapping[str, Any] | None) -> str | None:
    """The subject's commonName, else the first subjectAltName value."""
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    for _kind, value in cert.get("subjectAltName", ()):
        return str(value)
    return None


# ---------------------------------------------------------------------------
# Authentication
# ---------------------------------------------------------------------------


class Authenticator:
    """The security settings of one listener, applied to each client.

    ``tls`` and ``loopback`` describe the listener; argon2 verification is
    done by :meth:`check_password`, which blocks for tens of milliseconds
    (run it in a thread).
    """

    def __init__(self, security: AmqpSecurity, *, tls: bool, loopback: bool) -> None:
        self.security = security
        self.tls = tls
        users = security.users
        self.allow_anonymous = (
            security.allow_anonymous
            if security.allow_anonymous is not None
            else users is None and loopback
        )
        self.plain = users is not None and (tls or loopback or security.allow_plaintext)
        self._hasher: Any = None

    def mechanisms(self) -> tuple[str, ...]:
        """What ``sasl-mechanisms`` offers, strongest first."""
        mechs = []
        if self.tls:
            mechs.append("EXTERNAL")
        if self.plain:
            mechs.append("PLAIN")
        if self.allow_anonymous:
            mechs.append("ANONYMOUS")
        return tuple(mechs)

    def principal(self, name: str, mechanism: str) -> Principal | None:
        """The rights of ``name``; ``None`` when a users file does not list it."""
        users = self.security.users
        if users is None:
            return dataclasses.replace(OPEN_RIGHTS, name=name, mechanism=mechanism)
        user = users.get(name)
        if user is None:
            return None
        return Principal(user.name, user.admin, user.publish, user.consume, mechanism)

    def external(self, cert: Mapping[str, Any] | None) -> Principal | None:
        """The principal of a TLS client certificate (EXTERNAL), or ``None``."""
        found = certificate_identity(cert)
        if not self.tls or found is None:
            return None
        return self.principal(self.security.identities.get(found, found), "EXTERNAL")

    def anonymous(self) -> Principal | None:
        if not self.allow_anonymous:
            return None
        return self.principal(ANONYMOUS, "ANONYMOUS")

    def check_password(self, response: bytes) -> Principal | None:
        """PLAIN: ``authzid NUL authcid NUL password``; the user's principal
        when the password matches its hash, else ``None``.  Blocks (argon2)."""
        users = self.security.users
        if not self.plain or users is None:
            return None
        parts = response.split(b"\0")
        if len(parts) != 3:
            return None
        authzid, authcid, password = (p.decode("utf-8", "replace") for p in parts)
        user = users.get(authcid)
        if user is None or (authzid and authzid != authcid):
            return None
        if self._hasher is None:
            from argon2 import PasswordHasher

            self._hasher = PasswordHasher()
        try:
            self._hasher.verify(user.password_hash, password)
        except Exception:  # argon2 raises VerifyMismatchError, InvalidHashError, ...
            return None
        return self.principal(authcid, "PLAIN")


# ---------------------------------------------------------------------------
# SASL frames
# ---------------------------------------------------------------------------


def encode_sasl_frame(descriptor: int, fields: list[Any]) -> bytes:
    """One SASL frame: the header, then the performative as a described list.

    ``fields`` holds lists of names (sent as symbol arrays), names (symbols),
    ints (sent as ubyte: the only int SASL sends is the code) and bytes.
    """
    data = Data()
    data.put_described()
    data.enter()
    data.put_ulong(descriptor)
    data.put_list()
    data.enter()
    for value in fields:
        if isinstance(value, list):
            data.put_array(False, Data.SYMBOL)
            data.enter()
            for item in value:
                data.put_symbol(proton.symbol(item))
            data.exit()
        elif isinstance(value, int):
            data.put_ubyte(value)
        elif isinstance(value, str):
            data.put_symbol(proton.symbol(value))
        else:
            data.put_binary(bytes(value))
    data.exit()
    data.exit()
    body = bytes(data.encode())
    return SASL_FRAME.pack(SASL_FRAME.size + len(body), 2, SASL_FRAME_TYPE, 0) + body


def parse_sasl_frame_untrusted(buffer: bytes) -> tuple[int, list[Any], int] | None:
    """The first SASL frame in ``buffer``: ``(descriptor, fields, size)``, or
    ``None`` when more bytes are needed.  Raises :class:`RemoteProtocolError`
    for a frame that is too large, not SASL, or not a described list."""
    if len(buffer) < SASL_FRAME.size:
        return None
    size, doff, kind, _channel = SASL_FRAME.unpack_from(buffer)
    if kind != SASL_FRAME_TYPE or doff < 2 or not doff * 4 <= size <= MAX_SASL_FRAME:
        raise RemoteProtocolError(f"bad SASL frame header (size {size}, type {kind})")
    if len(buffer) < size:
        return None
    data = Data()
    try:
        data.decode(bytes(buffer[doff * 4 : size]))
        data.rewind()
        data.next()
        value = data.get_object()
    except Exception as exc:  # DataException on bad bytes
        raise RemoteProtocolError(f"undecodable SASL frame: {exc}") from exc
    if (
        not isinstance(value, proton.Described)
        or not isinstance(value.descriptor, int)
        or not isinstance(value.value, list)
    ):
        raise RemoteProtocolError("a SASL frame must hold a list described by a number")
    # Binary fields are views of the decoder's buffer: copy them while it lives.
    fields = [bytes(v) if isinstance(v, memoryview) else v for v in value.value]
    return int(value.descriptor), fields, size


def mechanisms_frame(mechanisms: tuple[str, ...]) -> bytes:
    return encode_sasl_frame(SASL_MECHANISMS, [list(mechanisms)])


def outcome_frame(ok: bool) -> bytes:
    return encode_sasl_frame(SASL_OUTCOME, [SASL_OK if ok else SASL_AUTH])


def sasl_init_fields(fields: list[Any]) -> tuple[str, bytes]:
    """``(mechanism, initial_response)`` of a sasl-init's fields; raises
    :class:`RemoteProtocolError` when the mechanism is missing."""
    if not fields or not isinstance(fields[0], str):
        raise RemoteProtocolError("sasl-init without a mechanism")
    response = fields[1] if len(fields) > 1 and fields[1] is not None else b""
    return str(fields[0]), bytes(response)


# ---------------------------------------------------------------------------
# The exchange, on a stream
# ---------------------------------------------------------------------------


async def authenticate_untrusted(
    stream: trio.abc.Stream,
    auth: Authenticator,
    *,
    certificate: Mapping[str, Any] | None,
    peer: str,
) -> tuple[Principal | None, bytes]:
    """Run the SASL exchange on ``stream`` (see the module docstring).

    Returns the client's principal and the bytes already read that belong to
    Proton (the AMQP header onwards), or ``(None, b"")`` when the client is
    refused (it has been told so; close the stream).  The caller bounds the
    time it takes.  Raises the stream's errors (``trio.BrokenResourceError``).
    """
    buffer = b""
    while len(buffer) < len(SASL_HEADER) and SASL_HEADER.startswith(buffer):
        chunk = await stream.receive_some(MAX_SASL_FRAME)
        if not chunk:
            return None, b""
        buffer += chunk
    principal: Principal | None = None
    if not buffer.startswith(SASL_HEADER):
        # No SASL: the AMQP header (or garbage, which Proton answers).
        principal = auth.external(certificate) or auth.anonymous()
        if principal is None:
            log.info("amqp peer=%s refused: no SASL, and anonymous clients are refused", peer)
            await stream.send_all(SASL_HEADER)
            return None, b""
        return principal, buffer
    offered = auth.mechanisms()
    await stream.send_all(SASL_HEADER + mechanisms_frame(offered))
    buffer = buffer[len(SASL_HEADER) :]
    try:
        while (frame := parse_sasl_frame_untrusted(buffer)) is None:
            chunk = await stream.receive_some(MAX_SASL_FRAME)
            if not chunk:
                return None, b""
            buffer += chunk
        descriptor, fields, size = frame
        if descriptor != SASL_INIT:
            raise RemoteProtocolError(f"expected sasl-init, got descriptor {descriptor:#x}")
        mechanism, response = sasl_init_fields(fields)
    except RemoteProtocolError as exc:
        log.info("amqp peer=%s refused: %s", peer, exc)
        return None, b""
    if mechanism in offered:
        if mechanism == "EXTERNAL" or (mechanism == "ANONYMOUS" and certificate):
            # Under TLS the certificate names the client whatever it picked.
            principal = auth.external(certificate)
        elif mechanism == "ANONYMOUS":
            principal = auth.anonymous()
        elif mechanism == "PLAIN":
            principal = await trio.to_thread.run_sync(auth.check_password, response)
    await stream.send_all(outcome_frame(principal is not None))
    if principal is None:
        log.info(
            "amqp peer=%s refused: SASL %s failed (offered %s)", peer, mechanism, " ".join(offered)
        )
        return None, b""
    return principal, buffer[size:]


async def open_client_untrusted(
    stream: trio.SocketStream,
    ssl_context: ssl.SSLContext | None,
    auth: Authenticator,
    *,
    peer: str,
) -> tuple[trio.abc.Stream, dict[str, Any] | None, Principal | None, bytes]:
    """TLS (with ``ssl_context``), then SASL, within ``HANDSHAKE_TIMEOUT_S``:
    ``(stream, certificate, principal, received)`` as
    :func:`authenticate_untrusted`; principal ``None``: refused or failed
    (close the stream).  Never raises for the client's faults."""
    conn_stream: trio.abc.Stream = stream
    cert: dict[str, Any] | None = None
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            if ssl_context is not None:
                tls = trio.SSLStream(stream, ssl_context, server_side=True)
                await tls.do_handshake()
                cert = tls.getpeercert()
                conn_stream = tls
            principal, received = await authenticate_untrusted(
                conn_stream, auth, certificate=cert, peer=peer
            )
    except (trio.TooSlowError, trio.BrokenResourceError, OSError) as exc:
        log.info("amqp peer=%s TLS or SASL handshake failed: %s", peer, exc)
        return conn_stream, cert, None, b""
    return conn_stream, cert, principal, received
