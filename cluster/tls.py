"""Mutual TLS: the certificate files named in config and the one place SSL contexts are built.

The WAN link (the egress is a client, the ingress a server) and the
broker's AMQP listener (a server) use these two factories, so both ends
of every connection are configured the same way.

On the link, a certificate signed by the CA is not enough: each side pins
the names the other side's certificate may carry (``tls.peer_names``,
default the peer's cluster id) and checks them after the handshake
(:func:`peer_name_refusal`), since the egress dials addresses, not names,
and the server side of Python's ssl checks no name at all.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: this process's certificate and key, and the CA that signs its peers."""

    cert: str
    key: str
    ca: str


def server_context(tls: TlsFiles) -> ssl.SSLContext:
    """A server context that requires a client certificate signed by ``tls.ca``.

    Reads the files now; raises ``OSError`` or ``ssl.SSLError`` when one is
    missing or not valid PEM.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tls.ca)
    context.load_cert_chain(tls.cert, tls.key)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: TlsFiles) -> ssl.SSLContext:
    """A client context that presents ``tls.cert`` and checks the server's
    certificate against ``tls.ca``, but not the server's host name: peers are
    listed by address, and the link pins names after the handshake
    (:func:`peer_name_refusal`).  Reads the files now, raising as
    :func:`server_context`.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
    context.load_cert_chain(tls.cert, tls.key)
    context.check_hostname = False
    return context


def certificate_names(cert: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The names a peer certificate (``SSLSocket.getpeercert()``) stands for:
    its subjectAltName DNS entries, or, when it has none, its subject's
    commonName; empty without a certificate."""
    if not cert:
        return ()
    dns = tuple(str(value) for kind, value in cert.get("subjectAltName", ()) if kind == "DNS")
    if dns:
        return dns
    return tuple(
        str(value) for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"
    )


def peer_name_refusal(
    cert: Mapping[str, Any] | None, pinned: Sequence[str], *, key: str = "tls.peer_names"
) -> str | None:
    """Why a peer with certificate ``cert`` is refused: none of its names
    (:func:`certificate_names`) is one of ``pinned`` (compared without case,
    as DNS names are; no wildcards).  ``None`` when one is."""
    names = certificate_names(cert)
    wanted = {name.casefold() for name in pinned}
    if any(name.casefold() in wanted for name in names):
        return None
    if not names:
        return (
            "the certificate names nobody (no DNS subjectAltName, no commonName); "
            f"{key} pins {list(pinned)}"
        )
    shown = ", ".join(repr(name) for name in names)
    return f"certificate name {shown} is not one of {list(pinned)} (pinned by {key})"


# What an OpenSSL reason (SSLError.reason) means for a person on the link.
_NOT_TLS = "the peer does not speak TLS (its config says insecure: true?)"
_TLS_REASONS = {
    "CERTIFICATE_VERIFY_FAILED": "the peer's certificate is not signed by our tls.ca",
    "TLSV1_ALERT_UNKNOWN_CA": "the peer does not trust our certificate (not signed by its tls.ca)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the peer refused our certificate",
    "TLSV1_ALERT_DECRYPT_ERROR": "the peer refused our certificate",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "the peer sent no certificate",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the peer wants a certificate and we sent none",
    "WRONG_VERSION_NUMBER": _NOT_TLS,
    "HTTP_REQUEST": _NOT_TLS,
    "RECORD_LAYER_FAILURE": _NOT_TLS,
    "PACKET_LENGTH_TOO_LONG": _NOT_TLS,
    # A refusing trio peer closes without sending its alert.
    "UNEXPECTED_EOF_WHILE_READING": (
        "the peer closed the connection during the TLS handshake: it refused our certificate "
        "(not signed by its tls.ca?) or does not speak TLS; its /status last_error says which"
    ),
}


def ssl_error_in(exc: BaseException) -> ssl.SSLError | None:
    """The ``ssl.SSLError`` behind ``exc`` (trio raises ``BrokenResourceError``
    from it), or ``None``."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__
    return None


def tls_failure_text(exc: BaseException) -> str | None:
    """One line for a person when ``exc`` is (or comes from) a TLS failure:
    what OpenSSL said and what it usually means; ``None`` otherwise."""
    error = ssl_error_in(exc)
    if error is None:
        return None
    reason = str(getattr(error, "reason", None) or "")
    detail = getattr(error, "verify_message", None) or reason or str(error)
    meaning = _TLS_REASONS.get(reason)
    return f"TLS failed ({detail})" + (f": {meaning}" if meaning else "")


# client_auth_type of a web config (the Prometheus exporter toolkit's names) ->
# what Python's ssl does.  RequestClientCert and RequireAnyClientCert (ask for a
# certificate but do not verify it) have no equivalent in Python's ssl.
CLIENT_AUTH_TYPES = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}


@dataclass(frozen=True, slots=True)
class WebTls:
    """The ``tls_server_config`` of a web config: the server's certificate and
    key, and (when ``client_auth`` verifies clients) the CA that signs them.
    ``client_auth`` is a key of :data:`CLIENT_AUTH_TYPES`."""

    cert: str
    key: str
    client_ca: str | None = None
    client_auth: str = "NoClientCert"


def web_server_context(tls: WebTls) -> ssl.SSLContext:
    """A server context for the observability endpoint (HTTPS).

    Reads the files now; raises ``OSError`` or ``ssl.SSLError`` when one is
    missing or not valid PEM, ``KeyError`` for an unknown ``client_auth``.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tls.client_ca)
    context.load_cert_chain(tls.cert, tls.key)
    context.verify_mode = CLIENT_AUTH_TYPES[tls.client_auth]
    return context
