"""The link's transport security: a real Egress and a real Ingress over loopback
sockets with real TLS (lab/certs.py certificates): mutual TLS comes up, and a
plaintext egress, a certificate of another CA, and a certificate of the
right CA with a name that is not pinned are refused, with the reason in
both sides' status.  Then ``insecure: true``: the warning, /status, the gauge."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from cluster.addresses import Address
from cluster.tls import TlsFiles, server_context
from gateway.egress import Egress
from gateway.ingress import Ingress
from gateway.linkconnect import open_link
from gateway.metrics import families_from_snapshot
from gateway.roles import RoleSignal, SidecarRole
from gateway.sidecar import INSECURE_WARNING, Sidecar
from gateway.spool import Spool
from gateway.statusdoc import status_document
from gateway.tap import Tap
from lab.certs import make_site_certs
from protocol import cluster as pc
from protocol.errors import BusError
from tests.support.linkpeer import MemberStandIn, sidecar_config
from tests.support.membus import MemoryBus, open_memory_member

WITHIN_S = 10.0  # real seconds: handshakes on loopback take milliseconds


async def wait_until(condition: Callable[[], bool]) -> None:
    """Until ``condition()`` holds (checked every 10 ms), at most WITHIN_S."""
    with trio.fail_after(WITHIN_S):
        while True:
            if condition():
                return
            await trio.sleep(0.01)  # real sockets: there is no event to wait on


@dataclass
class Certs:
    p: TlsFiles  # site-p's certificate, our CA
    d: TlsFiles
    x: TlsFiles  # site-x's: our CA, a name nobody pins
    foreign_p: TlsFiles  # "site-p" signed by another CA (trusting ours)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    folder = tmp_path_factory.mktemp("certs")
    ours = make_site_certs(folder / "ours", ["site-p", "site-d", "site-x"])
    theirs = make_site_certs(folder / "theirs", ["site-p"])

    def files(cert: Path, key: Path, ca: Path) -> TlsFiles:
        return TlsFiles(cert=str(cert), key=str(key), ca=str(ca))

    return Certs(
        p=files(ours["site-p"].cert, ours["site-p"].key, ours["site-p"].ca),
        d=files(ours["site-d"].cert, ours["site-d"].key, ours["site-d"].ca),
        x=files(ours["site-x"].cert, ours["site-x"].key, ours["site-x"].ca),
        foreign_p=files(theirs["site-p"].cert, theirs["site-p"].key, ours["site-p"].ca),
    )


@dataclass
class Pair:
    egress: Egress
    ingress: Ingress


@asynccontextmanager
async def linked(
    tmp_path: Path, *, p_tls: TlsFiles | None, d_tls: TlsFiles | None
) -> AsyncIterator[Pair]:
    """P's Egress dialling D's Ingress on 127.0.0.1, with these certificates
    (None: plaintext), each side pinning the other's cluster id."""
    for side in ("p", "d"):
        (tmp_path / side).mkdir()
    d_config = sidecar_config(tmp_path / "d", primary=False, site="site-d", peer="site-p")
    p_config = dataclasses.replace(
        sidecar_config(tmp_path / "p", primary=True, site="site-p", peer="site-d"), tls=p_tls
    )
    d_member = MemberStandIn("site-d")
    # D holds P's first command: P streams (no resync, which the stand-ins do not stage).
    d_member.apply(pc.Replicated("site-p", 1, 1, 1, 0, (), ()))
    ingress = Ingress(
        d_config,
        d_member,  # type: ignore[arg-type]
        role=lambda: SidecarRole.INGRESS,
        active=lambda: None,
        ssl_context=None if d_tls is None else server_context(d_tls),
        pinned=("site-p",),
    )
    spool = Spool.open(p_config.spool_dir, max_bytes=1 << 20, segment_bytes=1 << 16, fsync="never")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(ingress.serve, "127.0.0.1", 0)

        async def connect(address: Address) -> trio.abc.Stream:
            d = Address("127.0.0.1", port)
            return await open_link(d, tls=p_config.tls, pinned=("site-d",), site="site-p")

        egress = Egress(
            p_config,
            MemberStandIn("site-p"),  # type: ignore[arg-type]
            Tap(p_config.rules, origin_cluster="site-p"),
            spool=lambda: spool,
            role=lambda: SidecarRole.EGRESS,
            roles=RoleSignal(),
            connect=connect,
        )
        nursery.start_soon(egress.serve)
        yield Pair(egress, ingress)
        nursery.cancel_scope.cancel()
    spool.close()


async def test_mutual_tls_with_pinned_names_brings_the_link_up(
    tmp_path: Path, certs: Certs
) -> None:
    async with linked(tmp_path, p_tls=certs.p, d_tls=certs.d) as pair:
        await wait_until(lambda: pair.egress.status.state == "up")
        assert pair.ingress.status.state == "up"
        assert pair.egress.status.last_error == pair.ingress.status.last_error == ""
        for side in (pair.egress, pair.ingress):
            stats = side.link_statistics()
            assert stats.security == "mutual-tls"
            assert (stats.tls_handshake_failures_total, stats.peer_name_refusals_total) == (0, 0)


async def test_a_plaintext_egress_is_refused_by_a_tls_ingress(tmp_path: Path, certs: Certs) -> None:
    async with linked(tmp_path, p_tls=None, d_tls=certs.d) as pair:
        await wait_until(lambda: bool(pair.ingress.status.last_error))
        await wait_until(lambda: bool(pair.egress.status.last_error))
        error = pair.ingress.status.last_error
        assert error.startswith("ingress: TLS handshake with 127.0.0.1:"), error
        assert "failed: TLS failed (WRONG_VERSION_NUMBER)" in error, error
        assert "does not speak TLS" in error, error
        assert pair.ingress.status.tls_refused["handshake"] >= 1
        assert pair.ingress.status.state == "down"
        assert pair.egress.status.state != "up"


async def test_a_certificate_of_another_ca_is_refused(tmp_path: Path, certs: Certs) -> None:
    async with linked(tmp_path, p_tls=certs.foreign_p, d_tls=certs.d) as pair:
        await wait_until(lambda: bool(pair.ingress.status.last_error))
        await wait_until(lambda: "TLS failed" in pair.egress.status.last_error)
        assert "TLS handshake with 127.0.0.1:" in pair.ingress.status.last_error
        assert "the peer's certificate is not signed by our tls.ca" in (
            pair.ingress.status.last_error
        )
        # D closes without its alert (trio does not send it): P says what that means.
        assert "it refused our certificate (not signed by its tls.ca?)" in (
            pair.egress.status.last_error
        )
        assert pair.egress.status.tls_refused["handshake"] >= 1
        assert pair.egress.status.state != "up"


async def test_the_ingress_refuses_a_certificate_name_it_does_not_pin(
    tmp_path: Path, certs: Certs
) -> None:
    why = "certificate name 'site-x' is not one of ['site-p'] (pinned by tls.peer_names)"
    async with linked(tmp_path, p_tls=certs.x, d_tls=certs.d) as pair:
        await wait_until(lambda: why in pair.egress.status.last_error)
        await wait_until(lambda: why in pair.ingress.status.last_error)
        assert "site-d refuses the link from 127.0.0.1:" in pair.ingress.status.last_error
        assert pair.ingress.status.tls_refused["peer_name"] >= 1
        assert pair.egress.status.tls_refused["peer_name"] >= 1
        assert pair.ingress.link_statistics().peer_name_refusals_total >= 1
        assert pair.egress.status.state != "up"


async def test_the_egress_refuses_a_certificate_name_it_does_not_pin(
    tmp_path: Path, certs: Certs
) -> None:
    why = "certificate name 'site-x' is not one of ['site-d'] (pinned by tls.peer_names)"
    async with linked(tmp_path, p_tls=certs.p, d_tls=certs.x) as pair:
        await wait_until(lambda: why in pair.egress.status.last_error)
        # D hears it from P in an ERROR frame, right after the handshake.
        await wait_until(lambda: why in pair.ingress.status.last_error)
        assert "site-p refuses the link to 127.0.0.1:" in pair.egress.status.last_error
        assert pair.egress.status.tls_refused["peer_name"] >= 1
        assert pair.ingress.status.state == "down"


async def test_an_insecure_link_comes_up_and_says_so(tmp_path: Path) -> None:
    async with linked(tmp_path, p_tls=None, d_tls=None) as pair:
        await wait_until(lambda: pair.egress.status.state == "up")
        assert pair.egress.link_statistics().security == "insecure"
        assert pair.ingress.link_statistics().security == "insecure"


async def test_an_insecure_sidecar_warns_at_start_and_shows_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = sidecar_config(tmp_path, primary=True, site="site-p", peer="site-d")
    assert config.tls is None  # what the config loader makes of insecure: true

    async def unreachable(address: Address) -> trio.abc.Stream:
        raise OSError(f"{address} does not answer (test)")

    sidecar = Sidecar(
        config,
        open_member=open_memory_member(MemoryBus(group="site-p", expected_members=1)),
        connect=unreachable,
    )
    with caplog.at_level(logging.WARNING, logger="drgate.sidecar"):
        async with trio.open_nursery() as nursery:
            await nursery.start(_serve, sidecar)
            nursery.cancel_scope.cancel()
    assert INSECURE_WARNING in caplog.text
    assert "give tls: {cert, key, ca}" in INSECURE_WARNING
    stats = sidecar.statistics()
    assert status_document(stats)["link_security"] == "insecure"
    insecure = [
        sample.value
        for family in families_from_snapshot(stats)
        for sample in family.samples
        if sample.name == "drgate_link_insecure"
    ]
    assert insecure == [1.0]


async def _serve(sidecar: Sidecar, *, task_status: trio.TaskStatus[None]) -> None:
    try:
        await sidecar.serve(task_status=task_status)
    except* BusError:
        pass
