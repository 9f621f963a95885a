"""Certificates for a lab site pair: one CA and one certificate per site.

The WAN link runs mutual TLS by default (docs/operations.md, "Certificates
for the link"), so the lab makes what an operator would: a CA, and for each
site a certificate whose subjectAltName DNS entry (and commonName) is the
site's cluster id, the name the other site pins by default.  Every sidecar
of a site uses its site's certificate.  EC P-256 keys: fast to make and to
handshake with.

``python -m lab.certs DIR site-p site-d`` writes them for a hand-made setup.
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for any lab run, short enough that a copied lab key is soon worthless.
VALID_DAYS = 30


@dataclass(frozen=True, slots=True)
class SiteCert:
    """The PEM files of one site's certificate, and the CA's."""

    cert: Path
    key: Path
    ca: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def make_site_certs(
    directory: Path, sites: list[str], *, ca_name: str = "drgate lab CA"
) -> dict[str, SiteCert]:
    """A CA (``ca.pem``) and, for each site, ``SITE.pem`` and ``SITE.key``
    named after it, all in ``directory`` (made if absent)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(ca_name))
        .issuer_name(_name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    out = {}
    for site in sites:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(site))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(site)]), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
            .sign(ca_key, hashes.SHA256())
        )
        paths = SiteCert(directory / f"{site}.pem", directory / f"{site}.key", ca_path)
        paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, paths.key)
        out[site] = paths
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("sites", nargs="+", help="cluster ids, e.g. site-p site-d")
    args = parser.parse_args()
    for site, files in make_site_certs(args.directory, args.sites).items():
        print(f"{site}: tls: {{cert: {files.cert}, key: {files.key}, ca: {files.ca}}}")


if __name__ == "__main__":
    main()
