"""gateway.httpserver over real loopback sockets: slow clients, TLS and basic auth."""

from __future__ import annotations

import pytest
import trio

from gateway import httpserver
from gateway.httpserver import serve_http
from tests.support.statistics import broker

pytestmark = pytest.mark.integration


async def read_status(stream: trio.abc.Stream) -> int:
    """The status code of the response on ``stream`` (read to EOF)."""
    data = bytearray()
    while chunk := await stream.receive_some(65536):
        data += chunk
    return int(bytes(data).split(b" ", 2)[1])


async def start_server(nursery: trio.Nursery, **options: object) -> int:
    port: int = await nursery.start(
        lambda task_status: serve_http(
            "127.0.0.1", 0, snapshot=broker, task_status=task_status, **options
        )
    )
    return port


@pytest.mark.parametrize("idle", [32, 200])
async def test_clients_that_send_nothing_do_not_lock_out_a_scrape(idle: int) -> None:
    silent: list[trio.SocketStream] = []
    try:
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery)
            silent += [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(idle)]
            with trio.fail_after(2):
                scrape = await trio.open_tcp_stream("127.0.0.1", port)
                async with scrape:
                    await scrape.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert await read_status(scrape) == 200
                if idle > httpserver.MAX_CONNECTIONS:
                    # The oldest silent client was shed: closed without an answer.
                    assert await silent[0].receive_some(1) == b""
            nursery.cancel_scope.cancel()
    finally:
        for stream in silent:
            await trio.aclose_forcefully(stream)
