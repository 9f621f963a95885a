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
