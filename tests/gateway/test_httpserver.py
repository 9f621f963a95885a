"""gateway.httpserver over real loopback sockets: slow clients, TLS and basic auth."""

from __future__ import annotations

import base64
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trio
import trustme

from cluster.tls import WebTls
from cluster.webconfig import WebConfig
from gateway import httpserver
from gateway.httpserver import serve_http
from tests.gateway.test_webconfig import FAST_HASHER
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
            with trio.fail_after(10):
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


def scrape_https(
    port: int, context: ssl.SSLContext, credentials: tuple[str, str] | None
) -> tuple[int, str | None]:
    """GET /metrics over HTTPS with urllib: (status, WWW-Authenticate header)."""
    request = urllib.request.Request(f"https://127.0.0.1:{port}/metrics")
    if credentials is not None:
        token = base64.b64encode(":".join(credentials).encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, context=context, timeout=5) as response:
            return response.status, response.headers.get("WWW-Authenticate")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("WWW-Authenticate")


async def test_tls_with_client_certificates_and_basic_auth(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    server_cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    server_cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    web = WebConfig(
        path="web.yml",
        tls=WebTls(
            cert=str(tmp_path / "server.pem"),
            key=str(tmp_path / "server.key"),
            client_ca=str(tmp_path / "ca.pem"),
            client_auth="RequireAndVerifyClientCert",
        ),
        users=(("prometheus", FAST_HASHER.hash("s3cret")),),
    )
    with_cert = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    ca.issue_cert("prometheus.test").configure_cert(with_cert)
    without_cert = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))

    async with trio.open_nursery() as nursery:
        port = await start_server(nursery, web=web)
        with trio.fail_after(20):
            for credentials, expected in [
                (("prometheus", "s3cret"), (200, None)),
                (("prometheus", "s3cret"), (200, None)),  # again, from the cache
                (("prometheus", "wrong"), (401, 'Basic realm="drgate", charset="UTF-8"')),
                (("nobody", "s3cret"), (401, 'Basic realm="drgate", charset="UTF-8"')),
                (None, (401, 'Basic realm="drgate", charset="UTF-8"')),
            ]:
                got = await trio.to_thread.run_sync(scrape_https, port, with_cert, credentials)
                assert got == expected, credentials
            with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)) as caught:
                await trio.to_thread.run_sync(
                    scrape_https, port, without_cert, ("prometheus", "s3cret")
                )
            # Refused at the handshake (TLS 1.3: the client learns it at its
            # first read), never an HTTP answer.
            assert not isinstance(caught.value, urllib.error.HTTPError)
        nursery.cancel_scope.cancel()


async def test_another_interface_without_a_web_config_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve_http("0.0.0.0", 0, snapshot=broker, task_status=task_status)
        )
        await start_server(nursery)  # loopback: no warning
        nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "0.0.0.0" in warnings[0]
    assert "web_config" in warnings[0]
