"""The observability HTTP server: ``GET /metrics`` and ``GET /status`` on trio.

Theory of operation: a minimal HTTP/1.1 server on trio streams, one request
per connection (every response says ``Connection: close``), so nothing here
blocks trio and no thread is involved (but an argon2 password check, see
:mod:`gateway.webauth`).  A request head, TLS handshake included, is read up
to ``MAX_REQUEST_BYTES`` within ``REQUEST_HEAD_TIMEOUT_S`` (else ``431`` or
``408``), and a response must be taken within ``RESPONSE_TIMEOUT_S``.

Slow clients cannot lock others out: at most ``MAX_CONNECTIONS`` connections
are held, and a new one that finds them all taken sheds the oldest one still
waiting for its request head (closed without an answer).  A scraper sends its
request as soon as it connects, so it is never the oldest waiting for long;
clients that open sockets and send nothing only push each other out.  Only
when every held connection is past its head (being answered, each bounded by
``RESPONSE_TIMEOUT_S``) is a new one answered ``503``.

With a web config (:class:`cluster.webconfig.WebConfig`) the listener speaks
TLS (``tls_server_config``) and every request needs basic-auth credentials
(``basic_auth_users``), else ``401`` with ``WWW-Authenticate: Basic``.

``/metrics`` calls the snapshot function (a broker's or a sidecar's
``statistics()``, returning a :class:`cluster.statistics.NodeStatistics`)
once and renders it through :class:`gateway.metrics.SnapshotCollector`;
``/status`` renders the same snapshot as JSON with rates computed by a sampler
task that takes a snapshot every ``RATE_SAMPLE_INTERVAL_S`` (see
:class:`gateway.metrics.RateTracker`).
A snapshot function that raises makes that request a ``500`` (and the sampler
logs it and goes on): a bug in a statistics() must not stop the sidecar.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import logging

import trio

from cluster.tls import web_server_context
from cluster.webconfig import WebConfig
from gateway.metrics import (
    RateTracker,
    SnapshotFunction,
    build_registry,
    render_metrics,
)
from gateway.statusdoc import status_document
from gateway.webauth import BasicAuth

log = logging.getLogger(__name__)

# A request head (request line and headers) larger than this is refused with
# 431: a GET from Prometheus or `drgate status` is a few hundred bytes.
MAX_REQUEST_BYTES = 8192
# A client that has not finished its TLS handshake and request head by then
# is answered 408 and dropped (slowloris): a scraper on a LAN sends its
# request within milliseconds of connecting.
REQUEST_HEAD_TIMEOUT_S = 5.0
# A client that does not take its response within this is dropped: a
# /metrics body is tens of KiB, more than a socket buffer holds.
RESPONSE_TIMEOUT_S = 10.0
# Connections held at once.  Each is a trio task and a socket (a few KiB);
# a scraper, a few `drgate status` and a browser use a handful, the rest is
# room for idle or slow ones to be shed oldest first.
MAX_CONNECTIONS = 64
# The classic text format: every Prometheus 2.x reads it, and our metric and
# label names are plain ASCII, which is what generate_latest() writes.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Rates in /status come from snapshots taken this often.
RATE_SAMPLE_INTERVAL_S = 1.0

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

INDEX = b"drgate: GET /metrics (Prometheus text format) or GET /status (JSON)\n"
UNAUTHORIZED_HEADERS = ('WWW-Authenticate: Basic realm="drgate", charset="UTF-8"',)


def _response(
    status: int,
    body: bytes,
    content_type: str,
    *,
    head: bool = False,
    extra: tuple[str, ...] = (),
) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        "Cache-Control: no-store",
        *extra,
    ]
    if status == 405:
        lines.append("Allow: GET, HEAD")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    return data if head else data + body


def _text(status: int, text: str, *, head: bool = False, extra: tuple[str, ...] = ()) -> bytes:
    return _response(status, text.encode(), "text/plain; charset=utf-8", head=head, extra=extra)


def header_value(head: bytes, name: bytes) -> bytes | None:
    """The value of the first header ``name`` (any case) in a request head, or None."""
    for line in head.split(b"\r\n")[1:]:
        field, sep, value = line.partition(b":")
        if sep and field.strip().lower() == name.lower():
            return value.strip()
    return None


async def _read_head(stream: trio.abc.Stream) -> bytes | None:
    """The request head up to the blank line; None at EOF; raises ValueError when too big."""
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError("request head too large")
        data = await stream.receive_some(4096)
        if not data:
            return None
        buf += data
    head = bytes(buf[: buf.index(b"\r\n\r\n")])
    if len(head) > MAX_REQUEST_BYTES:
        raise ValueError("request head too large")
    return head


class ConnectionBudget:
    """At most ``limit`` connections held; a new one sheds the oldest held
    connection still waiting for its request head.  Connections are keyed by
    an int; each holds the cancel scope that sheds it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: dict[int, trio.CancelScope] = {}
        self.waiting: dict[int, trio.CancelScope] = {}  # oldest first
        self.shed_total = 0

    def admit(self, key: int, scope: trio.CancelScope) -> bool:
        """Hold connection ``key``, shedding the oldest waiting one if need be;
        False when every held connection is past its head (answer 503)."""
        if len(self.held) >= self.limit:
            if not self.waiting:
                return False
            oldest = next(iter(self.waiting))
            self.held.pop(oldest).cancel()
            del self.waiting[oldest]
            self.shed_total += 1
        self.held[key] = scope
        self.waiting[key] = scope
        return True

    def head_received(self, key: int) -> None:
        """Connection ``key`` has its request head: it is no longer shed."""
        self.waiting.pop(key, None)

    def release(self, key: int) -> None:
        self.held.pop(key, None)
        self.waiting.pop(key, None)


class ObservabilityServer:
    """Answers requests from one snapshot function; transport-free apart from streams.

    ``users`` (user -> argon2 hash) turns on basic authentication."""

    def __init__(
        self, snapshot: SnapshotFunction, *, users: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.snapshot = snapshot
        self.registry = build_registry(snapshot)
        self.rates = RateTracker()
        self.auth = BasicAuth(users) if users else None
        self.connections = ConnectionBudget(MAX_CONNECTIONS)
        self._keys = itertools.count()

    def sample(self, now: float) -> None:
        """Take one snapshot for the rates (errors are logged, never raised)."""
        try:
            self.rates.observe(now, self.snapshot())
        except Exception:
            log.exception("statistics() failed while sampling rates")

    def respond(self, head: bytes) -> bytes:
        """The full response bytes for one (authenticated) request head."""
        request_line = head.split(b"\r\n", 1)[0]
        parts = request_line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return _text(400, "bad request line\n")
        method, target = parts[0], parts[1]
        if method not in (b"GET", b"HEAD"):
            return _text(405, "only GET and HEAD are served\n")
        is_head = method == b"HEAD"
        path = target.split(b"?", 1)[0]
        try:
            if path == b"/metrics":
                body = render_metrics(self.registry)
                return _response(200, body, METRICS_CONTENT_TYPE, head=is_head)
            if path == b"/status":
                document = status_document(self.snapshot(), self.rates.rates())
                document["rate_window_seconds"] = self.rates.span
                body = (json.dumps(document, sort_keys=True) + "\n").encode()
                return _response(200, body, "application/json", head=is_head)
        except Exception as exc:
            log.exception("statistics() failed while serving %s", path.decode("latin-1"))
            return _text(500, f"statistics snapshot failed: {exc!r}\n", head=is_head)
        if path == b"/":
            return _response(200, INDEX, "text/plain; charset=utf-8", head=is_head)
        return _text(404, "not found: try /metrics or /status\n", head=is_head)

    async def answer(self, head: bytes) -> bytes:
        """:meth:`respond`, after the credentials when authentication is on."""
        if self.auth is not None and not await self.auth.check(
            header_value(head, b"authorization")
        ):
            return _text(401, "credentials needed\n", extra=UNAUTHORIZED_HEADERS)
        return self.respond(head)

    async def handle(self, stream: trio.abc.Stream) -> None:
        """Serve one connection: one request, one response, close."""
        key = next(self._keys)
        try:
            with trio.CancelScope() as shed:
                if not self.connections.admit(key, shed):
                    with trio.move_on_after(RESPONSE_TIMEOUT_S):
                        await stream.send_all(_text(503, "too many connections\n"))
                    return
                try:
                    await self._serve_one(stream, key)
                finally:
                    self.connections.release(key)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The client went away (or failed its TLS handshake); its request dies with it.
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _serve_one(self, stream: trio.abc.Stream, key: int) -> None:
        response, head = None, None
        with trio.move_on_after(REQUEST_HEAD_TIMEOUT_S) as deadline:
            try:
                head = await _read_head(stream)
            except ValueError:
                response = _text(431, "request head too large\n")
        if deadline.cancelled_caught:
            response = _text(408, "request timeout\n")
        elif response is None:
            if head is None:
                return
            self.connections.head_received(key)
            response = await self.answer(head)
        with trio.move_on_after(RESPONSE_TIMEOUT_S):
            await stream.send_all(response)

    async def serve_sampler(self) -> None:
        """Sample the snapshot for /status rates, forever."""
        while True:
            self.sample(trio.current_time())
            await trio.sleep(RATE_SAMPLE_INTERVAL_S)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def serve_http(
    host: str,
    port: int,
    *,
    snapshot: SnapshotFunction,
    web: WebConfig | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/metrics`` and ``/status`` on host:port until cancelled, with
    the TLS and basic auth of ``web`` (None: plain HTTP, no authentication).

    ``task_status.started(port)`` reports the bound port (useful with port 0).
    Raises ``OSError`` when the address cannot be bound, ``OSError`` or
    ``ssl.SSLError`` when the web config's certificate files cannot be read.
    """
    server = ObservabilityServer(snapshot, users=web.users if web else ())
    context = web_server_context(web.tls) if web is not None and web.tls else None
    listeners: list[trio.abc.Listener[trio.abc.Stream]] = list(
        await trio.open_tcp_listeners(port, host=host)
    )
    bound = listeners[0].socket.getsockname()[1]  # type: ignore[attr-defined]
    if context is not None:
        listeners = [trio.SSLListener(each, context, https_compatible=True) for each in listeners]
    if web is None and not _is_loopback(host):
        log.warning(
            "/metrics and /status served on %s:%d without metrics.web_config: anyone who "
            "reaches it reads them (add a web config with TLS and basic_auth_users)",
            host,
            bound,
        )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_sampler)
        nursery.start_soon(trio.serve_listeners, server.handle, listeners)
        log.info(
            "observability HTTP%s server listening on %s:%d",
            "S" if context else "",
            host,
            bound,
        )
        task_status.started(bound)
