"""cluster.tls: the one factory of SSL contexts, used by the link and the AMQP listener."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import trustme

from cluster.tls import (
    TlsFiles,
    certificate_names,
    client_context,
    peer_name_refusal,
    server_context,
)


def tls_files(ca: trustme.CA, folder: Path, name: str) -> TlsFiles:
    cert = ca.issue_cert(f"{name}.test")
    cert.private_key_pem.write_to_path(str(folder / f"{name}.key"))
    cert.cert_chain_pems[0].write_to_path(str(folder / f"{name}.pem"))
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    return TlsFiles(
        cert=str(folder / f"{name}.pem"), key=str(folder / f"{name}.key"), ca=str(folder / "ca.pem")
    )


def test_server_requires_a_client_certificate_and_client_skips_the_host_name(
    tmp_path: Path,
) -> None:
    files = tls_files(trustme.CA(), tmp_path, "node")
    server = server_context(files)
    assert server.verify_mode == ssl.CERT_REQUIRED
    client = client_context(files)
    assert client.verify_mode == ssl.CERT_REQUIRED
    assert client.check_hostname is False  # peers are listed by address


async def handshake(server: trio.SSLStream[Any], client: trio.SSLStream[Any]) -> list[str]:
    """Both sides' handshakes over memory streams; the sides that failed.

    A side that fails closes its transport, so the other side fails too
    instead of waiting for bytes that never come."""
    failed: list[str] = []

    async def one(name: str, stream: trio.SSLStream[Any]) -> None:
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError:
            failed.append(name)
            await trio.aclose_forcefully(stream.transport_stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "server", server)
        nursery.start_soon(one, "client", client)
    return sorted(failed)


def pair(server_files: TlsFiles, client_files: TlsFiles) -> tuple[trio.SSLStream[Any], ...]:
    left, right = trio.testing.memory_stream_pair()
    server = trio.SSLStream(left, server_context(server_files), server_side=True)
    client = trio.SSLStream(right, client_context(client_files), server_hostname="127.0.0.1")
    return server, client


async def test_a_client_and_a_server_of_one_ca_complete_a_mutual_handshake(
    tmp_path: Path,
) -> None:
    ca = trustme.CA()
    server, client = pair(tls_files(ca, tmp_path, "server"), tls_files(ca, tmp_path, "client"))
    assert await handshake(server, client) == []
    peer = server.getpeercert()
    assert peer is not None and ("DNS", "client.test") in peer["subjectAltName"]


async def test_the_server_refuses_a_client_certificate_of_another_ca(tmp_path: Path) -> None:
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    server_files = tls_files(trustme.CA(), tmp_path / "ours", "server")
    theirs = tls_files(trustme.CA(), tmp_path / "theirs", "client")
    # The client trusts the server; only its own certificate is foreign.
    client_files = TlsFiles(cert=theirs.cert, key=theirs.key, ca=server_files.ca)
    server, client = pair(server_files, client_files)
    # (With TLS 1.3 the client's side may finish before the server checks.)
    assert "server" in await handshake(server, client)


def test_a_missing_file_fails_when_the_context_is_built(tmp_path: Path) -> None:
    files = TlsFiles(cert=str(tmp_path / "absent.pem"), key=str(tmp_path / "absent.key"), ca="")
    with pytest.raises(OSError):
        server_context(files)


def test_certificate_names_are_the_dns_entries_else_the_common_name() -> None:
    both = {
        "subject": ((("commonName", "node-1"),),),
        "subjectAltName": (("DNS", "site-d"), ("IP Address", "10.0.0.1"), ("DNS", "d.example")),
    }
    assert certificate_names(both) == ("site-d", "d.example")
    cn_only = {"subject": ((("organizationName", "ops"),), (("commonName", "site-d"),))}
    assert certificate_names(cn_only) == ("site-d",)
    assert certificate_names({"subjectAltName": (("IP Address", "10.0.0.1"),)}) == ()
    assert certificate_names(None) == ()


def test_a_pinned_name_matches_without_case_and_never_by_the_cn_beside_dns_entries() -> None:
    cert = {"subject": ((("commonName", "site-d"),),), "subjectAltName": (("DNS", "Site-D2"),)}
    assert peer_name_refusal(cert, ["site-d2"]) is None
    assert peer_name_refusal(cert, ["site-d"]) == (
        "certificate name 'Site-D2' is not one of ['site-d'] (pinned by tls.peer_names)"
    )
    assert "names nobody" in (peer_name_refusal({}, ["site-d"]) or "")
