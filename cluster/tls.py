"""Mutual TLS: the certificate files named in config and the one place SSL contexts are built.

The WAN link (the egress is a client, the ingress a server) and the
broker's AMQP listener (a server) use these two factories, so both ends
of every connection are configured the same way.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass


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
    certificate against ``tls.ca``, but not the server's host name (peers are
    listed by address).  Reads the files now, raising as :func:`server_context`.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
    context.load_cert_chain(tls.cert, tls.key)
    context.check_hostname = False
    return context


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
