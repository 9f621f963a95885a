"""gateway.webconfig and the config key that names it (``metrics.web_config``)."""

from __future__ import annotations

from pathlib import Path

import argon2
import pytest
import trustme

from cluster.addresses import Address
from cluster.bus.auth import write_key_file
from cluster.tls import WebTls
from gateway.brokerconfig import load_broker_config
from gateway.config import load_sidecar_config
from protocol.errors import ConfigError
from tests.gateway.test_config import BROKER, sidecar, write

# Cheap parameters: the tests check many hashes.
FAST_HASHER = argon2.PasswordHasher(time_cost=1, memory_cost=64, parallelism=1)


def pem_files(folder: Path) -> tuple[Path, Path, Path]:
    """(cert, key, ca) PEM files of a server certificate for 127.0.0.1."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.cert_chain_pems[0].write_to_path(str(folder / "metrics.pem"))
    cert.private_key_pem.write_to_path(str(folder / "metrics.key"))
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    return folder / "metrics.pem", folder / "metrics.key", folder / "ca.pem"


def with_metrics(metrics: str) -> str:
    return sidecar().replace("metrics: 0.0.0.0:9464\n", metrics)


def test_metrics_listen_defaults_to_loopback(tmp_path: Path) -> None:
    config = load_sidecar_config(str(write(tmp_path, "s.yaml", with_metrics("metrics: {}\n"))))
    assert config.metrics == Address("127.0.0.1", 9464)
    assert config.metrics_web is None
    write_key_file(str(tmp_path / "bus.key"))  # the key BROKER's bus names
    broker = load_broker_config(str(write(tmp_path, "b.yaml", BROKER + "metrics: {}\n")))
    assert broker.metrics == Address("127.0.0.1", 9465)
    short = load_sidecar_config("s.yaml", with_metrics("metrics: 10.0.0.1:9000\n"))
    assert short.metrics == Address("10.0.0.1", 9000)


def test_a_web_config_with_tls_and_users_is_typed_once(tmp_path: Path) -> None:
    pem_files(tmp_path)
    hashed = FAST_HASHER.hash("s3cret")
    write(
        tmp_path,
        "web.yml",
        "tls_server_config:\n"
        "  cert_file: metrics.pem\n"
        "  key_file: metrics.key\n"
        "  client_ca_file: ca.pem\n"
        "  client_auth_type: RequireAndVerifyClientCert\n"
        f"basic_auth_users:\n  prometheus: '{hashed}'\n",
    )
    text = with_metrics("metrics: {listen: '0.0.0.0:9464', web_config: web.yml}\n")
    config = load_sidecar_config(str(write(tmp_path, "s.yaml", text)))
    assert config.metrics == Address("0.0.0.0", 9464)
    assert config.metrics_web is not None
    assert config.metrics_web.tls == WebTls(
        cert=str(tmp_path / "metrics.pem"),
        key=str(tmp_path / "metrics.key"),
        client_ca=str(tmp_path / "ca.pem"),
        client_auth="RequireAndVerifyClientCert",
    )
    assert config.metrics_web.users == (("prometheus", hashed),)


@pytest.mark.parametrize(
    ("web", "words"),
    [
        (None, ["'metrics.web_config'", "cannot be read", "docs/observability.md"]),
        (
            "basic_auth_users: {prometheus: '$2y$10$abcdefghijklmnopqrstuu'}\n",
            ["bcrypt", "drgate hash-password"],
        ),
        ("basic_auth_users: {prometheus: plain}\n", ["not an argon2 hash", "hash-password"]),
        (
            "tls_server_config: {cert_file: metrics.pem, key_file: metrics.key,"
            " client_ca_file: ca.pem}\n",
            ["NoClientCert", "client_auth_type: RequireAndVerifyClientCert"],
        ),
        (
            "tls_server_config: {cert_file: metrics.pem, key_file: metrics.key,"
            " client_auth_type: RequireAnyClientCert}\n",
            ["not supported", "VerifyClientCertIfGiven"],
        ),
        (
            "tls_server_config: {cert_file: metrics.pem, key_file: metrics.key,"
            " client_auth_type: RequireAndVerifyClientCert}\n",
            ["needs 'client_ca_file'"],
        ),
        ("tls_server_config: {cert_file: nowhere.pem, key_file: metrics.key}\n", ["not a file"]),
        ("basic_auth_users: {'a:b': x}\n", ["holds ':'"]),
        ("basic_auth_user: {}\n", ["unknown key 'basic_auth_user'", "basic_auth_users"]),
    ],
)
def test_a_bad_web_config_is_a_config_error_naming_the_fix(
    tmp_path: Path, web: str | None, words: list[str]
) -> None:
    pem_files(tmp_path)
    if web is not None:
        write(tmp_path, "web.yml", web)
    text = with_metrics("metrics:\n  web_config: web.yml\n")
    with pytest.raises(ConfigError) as caught:
        load_sidecar_config(str(write(tmp_path, "s.yaml", text)))
    found = [str(p) for p in caught.value.problems]
    assert len(found) == 1, found
    where = "s.yaml:" if web is None else "web.yml:"
    assert where in found[0]
    for word in words:
        assert word in found[0], found
