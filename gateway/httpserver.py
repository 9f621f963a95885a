"""The observability HTTP server: ``GET /metrics`` and ``GET /status`` on trio.

Theory of operation: a minimal HTTP/1.1 server on trio streams, one request
per connection (every response says ``Connection: close``), so nothing here
blocks trio and no thread is involved.  A request head is read up to
``MAX_REQUEST_BYTES`` within ``REQUEST_TIMEOUT_S``; anything longer or slower
is answered with an error or dropped.  At most ``MAX_CONNECTIONS`` requests
are served at once; more are answered ``503`` at once, so a scraper storm
cannot grow the process without bound.

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

import json
import logging

import trio

from gateway.metrics import (
    RateTracker,
    SnapshotFunction,
    build_registry,
    render_metrics,
)
from gateway.statusdoc import status_document

log = logging.getLogger(__name__)

# A request head (request line and headers) larger than this is refused with
# 431: a GET from Prometheus or `drgate status` is a few hundred bytes.
MAX_REQUEST_BYTES = 8192
# A client that has not sent its request head by then is dropped (slowloris).
REQUEST_TIMEOUT_S = 10.0
# Requests served at once; a scraper, a few `drgate status` and a browser fit.
MAX_CONNECTIONS = 32
# The classic text format: every Prometheus 2.x reads it, and our metric and
# label names are plain ASCII, which is what generate_latest() writes.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Rates in /status come from snapshots taken this often.
RATE_SAMPLE_INTERVAL_S = 1.0

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

INDEX = b"drgate: GET /metrics (Prometheus text format) or GET /status (JSON)\n"


def _response(status: int, body: bytes, content_type: str, *, head: bool = False) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        "Cache-Control: no-store",
    ]
    if status == 405:
        lines.append("Allow: GET, HEAD")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    return data if head else data + body


def _text(status: int, text: str, *, head: bool = False) -> bytes:
    return _response(status, text.encode(), "text/plain; charset=utf-8", head=head)


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


class ObservabilityServer:
    """Answers requests from one snapshot function; transport-free apart from streams."""

    def __init__(self, snapshot: SnapshotFunction) -> None:
        self.snapshot = snapshot
        self.registry = build_registry(snapshot)
        self.rates = RateTracker()
        self.active = 0

    def sample(self, now: float) -> None:
        """Take one snapshot for the rates (errors are logged, never raised)."""
        try:
            self.rates.observe(now, self.snapshot())
        except Exception:
            log.exception("statistics() failed while sampling rates")

    def respond(self, head: bytes) -> bytes:
        """The full response bytes for one request head."""
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

    async def handle(self, stream: trio.abc.Stream) -> None:
        """Serve one connection: one request, one response, close."""
        try:
            if self.active >= MAX_CONNECTIONS:
                await stream.send_all(_text(503, "too many connections\n"))
                return
            self.active += 1
            try:
                head = None
                with trio.move_on_after(REQUEST_TIMEOUT_S) as scope:
                    try:
                        head = await _read_head(stream)
                    except ValueError:
                        await stream.send_all(_text(431, "request head too large\n"))
                        return
                if scope.cancelled_caught:
                    await stream.send_all(_text(408, "request timeout\n"))
                    return
                if head is None:
                    return
                await stream.send_all(self.respond(head))
            finally:
                self.active -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The client went away; its request dies with it.
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def serve_sampler(self) -> None:
        """Sample the snapshot for /status rates, forever."""
        while True:
            self.sample(trio.current_time())
            await trio.sleep(RATE_SAMPLE_INTERVAL_S)


async def serve_http(
    host: str,
    port: int,
    *,
    snapshot: SnapshotFunction,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/metrics`` and ``/status`` on host:port until cancelled.

    ``task_status.started(port)`` reports the bound port (useful with port 0).
    Raises ``OSError`` when the address cannot be bound.
    """
    server = ObservabilityServer(snapshot)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_sampler)
        nursery.start_soon(trio.serve_listeners, server.handle, listeners)
        log.info("observability HTTP server listening on %s:%d", host, bound)
        task_status.started(bound)
