"""Opening either side of the WAN link, and what its failures mean to a
person (docs/operations.md, "Certificates for the link").

``open_link`` connects to one of D's sidecars: TCP, then mutual TLS, then the
check that D's certificate carries a pinned name (``tls.peer_names``);
``accept_link`` is D's side of the same, on a connection its ingress took.
``describe_error`` turns any failure of a connection into one line, TLS
failures explained; ``link_error_in`` finds the link refusal inside an
exception group; ``tls_refusal_reason`` says which TLS counter it goes to.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import MutableMapping, Sequence

import trio

from cluster.addresses import Address
from cluster.tls import TlsFiles, client_context, peer_name_refusal, tls_failure_text
from protocol import link
from protocol.errors import DrgateError, LinkError

__all__ = [
    "CONNECT_TIMEOUT_S",
    "HANDSHAKE_TIMEOUT_S",
    "READ_BYTES",
    "REFUSAL_GRACE_S",
    "accept_link",
    "describe_error",
    "link_error_in",
    "open_link",
    "tls_refusal_reason",
]

CONNECT_TIMEOUT_S = 5.0
# The most bytes one read of a link connection takes (either side).
READ_BYTES = 1 << 16
# At D: a TLS handshake that takes longer is abandoned (a peer that connects
# and says nothing does not hold a connection), and how long a refused egress
# gets to take the ERROR frame before the connection closes.
HANDSHAKE_TIMEOUT_S = 10.0
REFUSAL_GRACE_S = 5.0


def describe_error(exc: BaseException) -> str:
    """One line for a person: the messages of an exception (group), with
    what a TLS failure means."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe_error(e) for e in exc.exceptions)
    if isinstance(exc, DrgateError):
        return str(exc)
    tls = tls_failure_text(exc)
    return tls if tls is not None else f"{type(exc).__name__}: {exc}"


def link_error_in(exc: BaseException) -> LinkError | None:
    """The LinkError an exception is or carries: a link failure raised in a
    nursery's body reaches the caller wrapped in an exception group."""
    if isinstance(exc, LinkError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = link_error_in(inner)
            if found is not None:
                return found
    return None


def tls_refusal_reason(exc: BaseException) -> str | None:
    """``"peer_name"`` when a link failed on a pinned certificate name (either
    side's), ``"handshake"`` when its TLS handshake failed, else ``None``."""
    found = link_error_in(exc)
    if found is not None and found.code == link.LinkErrorCode.PEER_NOT_PINNED:
        return "peer_name"
    if isinstance(exc, BaseExceptionGroup):
        reasons = [tls_refusal_reason(inner) for inner in exc.exceptions]
        return next((r for r in reasons if r is not None), None)
    return "handshake" if tls_failure_text(exc) is not None else None


async def open_link(
    address: Address, *, tls: TlsFiles | None, pinned: Sequence[str], site: str
) -> trio.abc.Stream:
    """A connection to one of D's sidecars: TCP, then, with ``tls``, the TLS
    handshake and the check that D's certificate carries one of ``pinned``.

    The certificate files are read at each connection, so renewed ones are
    used without a restart.  Raises ``OSError`` when D cannot be reached in
    :data:`CONNECT_TIMEOUT_S`, ``trio.BrokenResourceError`` (from
    ``ssl.SSLError``) when the handshake fails, and a non-retriable
    :class:`LinkError` (``PEER_NOT_PINNED``) when D's certificate names
    none of ``pinned``, after telling D so in an ERROR frame.
    """
    with trio.move_on_after(CONNECT_TIMEOUT_S):
        stream: trio.abc.Stream = await trio.open_tcp_stream(address.host, address.port)
        if tls is None:
            return stream
        ssl_stream = trio.SSLStream(stream, client_context(tls), server_hostname=address.host)
        try:
            await ssl_stream.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        refusal = peer_name_refusal(ssl_stream.getpeercert(), pinned)
        if refusal is None:
            return ssl_stream
        text = f"{site} refuses the link to {address}: {refusal}"
        code = link.LinkErrorCode.PEER_NOT_PINNED
        sender = link.LinkSender(link.SenderConfig(site, "", incarnation=0, epoch=0))
        try:
            with trio.move_on_after(CONNECT_TIMEOUT_S):
                await ssl_stream.send_all(sender.send_error(int(code), text, retriable=False))
        finally:  # also when cancelled meanwhile
            await trio.aclose_forcefully(ssl_stream)
        raise LinkError(text, code=int(code), retriable=False)
    raise OSError(f"connect to {address} timed out")


async def accept_link(
    stream: trio.abc.Stream,
    context: ssl.SSLContext,
    *,
    pinned: Sequence[str],
    site: str,
    refused: MutableMapping[str, int],
) -> trio.SSLStream[trio.abc.Stream]:
    """D's side: the TLS handshake on a connection the ingress took, and the
    check that the egress's certificate carries one of ``pinned``.  Raises
    :class:`DrgateError` (the handshake failed) or :class:`LinkError`
    (``PEER_NOT_PINNED``, after telling the egress so), each counted in
    ``refused`` (``handshake``, ``peer_name``)."""
    peer = peer_address(stream) or "the egress"
    ssl_stream = trio.SSLStream(stream, context, server_side=True)
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            await ssl_stream.do_handshake()
    except (trio.BrokenResourceError, trio.TooSlowError) as exc:
        refused["handshake"] += 1
        why = tls_failure_text(exc) or f"no handshake within {HANDSHAKE_TIMEOUT_S:.0f} s"
        raise DrgateError(f"TLS handshake with {peer} failed: {why}") from exc
    refusal = peer_name_refusal(ssl_stream.getpeercert(), pinned)
    if refusal is None:
        return ssl_stream
    refused["peer_name"] += 1
    text = f"{site} refuses the link from {peer}: {refusal}"
    code = int(link.LinkErrorCode.PEER_NOT_PINNED)
    receiver = link.LinkReceiver(link.ReceiverConfig(cluster_id=site), now=trio.current_time())
    with (
        trio.move_on_after(REFUSAL_GRACE_S),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
    ):
        await ssl_stream.send_all(receiver.send_error(code, text, retriable=False))
        # Until the egress closes: closing with its HELLO unread would
        # reset the connection, and the reset could overtake the ERROR.
        while await ssl_stream.receive_some(READ_BYTES):
            pass
    raise LinkError(text, code=code, retriable=False)


def peer_address(stream: trio.abc.Stream) -> str:
    """``host:port`` of the other end of a TCP (or TLS over TCP) stream; "" otherwise."""
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    if isinstance(inner, trio.SocketStream):
        try:
            host, port = inner.socket.getpeername()[:2]
        except OSError:
            return ""
        return f"{host}:{port}"
    return ""
