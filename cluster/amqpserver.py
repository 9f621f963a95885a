"""The AMQP 1.0 server: a listener, and per client TLS, SASL and one
:class:`cluster.amqp.AmqpConnection` (see :mod:`cluster.amqp` for the
connection's engine and the handler a node implements)."""

from __future__ import annotations

import contextlib
import logging
import ssl

import trio

from cluster.amqp import IDLE_TIMEOUT_S, AmqpConnection, AmqpHandler
from cluster.amqpauth import (
    PLAINTEXT_WARNING,
    AmqpSecurity,
    Authenticator,
    connection_cap_refusal,
    is_loopback,
    open_client_untrusted,
)

log = logging.getLogger("cluster.amqp")  # the same logger as the connections

__all__ = ["serve_amqp"]


async def serve_amqp(
    handler: AmqpHandler,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    security: AmqpSecurity | None = None,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve AMQP 1.0 clients on ``host:port`` until cancelled.

    Start it with ``port = await nursery.start(serve_amqp, handler, host, 0)``:
    it reports the bound port.  With ``ssl_context`` (a server context; set
    ``verify_mode = ssl.CERT_REQUIRED`` and load a CA to require client
    certificates) every connection is TLS.  ``security`` (default: open
    mode, anonymous allowed on a loopback ``host``) says which SASL
    mechanisms are offered and who may connect (:mod:`cluster.amqpauth`);
    a refused client never reaches ``handler``.  Beyond
    ``security.max_connections`` connections, the next one is closed at its
    open with ``amqp:resource-limit-exceeded``.  One task per connection; a
    connection's failure never ends the server.
    """
    security = security if security is not None else AmqpSecurity()
    auth = Authenticator(security, tls=ssl_context is not None, loopback=is_loopback(host))
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    log.info(
        "amqp listening on %s:%d tls=%s sasl=%s",
        host,
        bound,
        ssl_context is not None,
        " ".join(auth.mechanisms()),
    )
    if ssl_context is None and not is_loopback(host):
        log.warning("amqp listener %s:%d: %s", host, bound, PLAINTEXT_WARNING)
    active = 0

    async def serve_one(stream: trio.SocketStream) -> None:
        nonlocal active
        active += 1
        try:
            await _serve_connection(
                handler,
                stream,
                ssl_context,
                auth,
                full=active > security.max_connections,
                idle_timeout_s=idle_timeout_s,
            )
        finally:
            active -= 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve_one, listeners)
        task_status.started(bound)


async def _serve_connection(
    handler: AmqpHandler,
    stream: trio.SocketStream,
    ssl_context: ssl.SSLContext | None,
    auth: Authenticator,
    *,
    full: bool,
    idle_timeout_s: float,
) -> None:
    """TLS, SASL, then the connection's engine; a refused client is closed."""
    try:
        sockname = stream.socket.getpeername()
        peer = f"{sockname[0]}:{sockname[1]}"
    except OSError:
        peer = "?"
    conn_stream, cert, principal, received = await open_client_untrusted(
        stream, ssl_context, auth, peer=peer
    )
    if principal is None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await conn_stream.aclose()
        return
    refusal = connection_cap_refusal(auth.security.max_connections) if full else None
    conn = AmqpConnection(
        handler,
        conn_stream,
        peer=peer,
        peer_certificate=cert,
        principal=principal,
        refusal=refusal,
        idle_timeout_s=idle_timeout_s,
    )
    log.info(
        "amqp conn=%d peer=%s identity=%s mechanism=%s open%s",
        conn.id,
        peer,
        conn.identity,
        principal.mechanism,
        " (refused: connection limit)" if full else "",
    )
    await conn.run(received)
