"""The observability endpoint's web config (``metrics.web_config``), read once at start-up.

The file has the shape of the Prometheus exporter toolkit's ``web-config.yml``,
so one file can serve drgate and the node exporter::

    tls_server_config:
      cert_file: /etc/drgate/metrics.pem
      key_file: /etc/drgate/metrics.key
      client_ca_file: /etc/drgate/scrapers-ca.pem     # optional
      client_auth_type: RequireAndVerifyClientCert    # or VerifyClientCertIfGiven, NoClientCert
    basic_auth_users:
      prometheus: $argon2id$v=19$m=65536,t=3,p=4$...

Password hashes are argon2 (``drgate hash-password`` prints one); bcrypt
hashes, which the toolkit also takes, are refused with that hint, since
drgate does not ship bcrypt.  Relative paths are relative to the web config's
folder.  Every mistake is a :class:`ConfigError` problem at its line.
"""

from __future__ import annotations

from pathlib import Path

import argon2

from cluster.tls import CLIENT_AUTH_TYPES, WebTls
from cluster.webconfig import WebConfig
from filters.yamldoc import Node, Problems, check_keys, expect_mapping, expect_str, parse
from protocol.errors import ConfigError, Location

HASH_HINT = "hash the password with 'drgate hash-password' and paste the $argon2id$... line"
VERIFYING = ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert")


def load_web_config(
    path: str, problems: Problems, *, key: str, location: Location
) -> WebConfig | None:
    """The web config in the file ``path``, named ``key`` in the config at
    ``location``; None with the mistakes added to ``problems``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        problems.error(
            location,
            f"{key} names {path!r}, which cannot be read: {exc.strerror}",
            "give the path of a web config file (docs/observability.md), or remove the key",
        )
        return None
    before = len(problems.errors)
    try:
        root = parse(text, path, error=ConfigError)
    except ConfigError as exc:
        problems.items.extend(exc.problems)
        return None
    fields = check_keys(
        root,
        problems,
        what=f"the web config ({key})",
        optional=("tls_server_config", "basic_auth_users"),
    )
    if fields is None:
        return None
    tls = (
        _load_tls(fields["tls_server_config"], problems, path)
        if "tls_server_config" in fields
        else None
    )
    users = (
        _load_users(fields["basic_auth_users"], problems) if "basic_auth_users" in fields else ()
    )
    if len(problems.errors) > before:
        return None
    return WebConfig(path=path, tls=tls, users=users)


def _file(node: Node, problems: Problems, *, what: str, config_path: str) -> str | None:
    text = expect_str(node, problems, what=what)
    if text is None:
        return None
    if not Path(text).is_absolute():
        text = str(Path(config_path).resolve().parent / text)
    if not Path(text).is_file():
        problems.error(
            node.location, f"{what} names {text!r}, which is not a file", "give a PEM file"
        )
        return None
    return text


def _load_tls(node: Node, problems: Problems, config_path: str) -> WebTls | None:
    fields = check_keys(
        node,
        problems,
        what="'tls_server_config'",
        required=("cert_file", "key_file"),
        optional=("client_ca_file", "client_auth_type"),
    )
    if fields is None:
        return None
    files = {
        name: _file(fields[name], problems, what=f"'{name}'", config_path=config_path)
        for name in ("cert_file", "key_file", "client_ca_file")
        if name in fields
    }
    auth = "NoClientCert"
    if "client_auth_type" in fields:
        auth = expect_str(fields["client_auth_type"], problems, what="'client_auth_type'") or auth
        if auth not in CLIENT_AUTH_TYPES:
            problems.error(
                fields["client_auth_type"].location,
                f"client_auth_type {auth!r} is not supported",
                f"use one of: {', '.join(CLIENT_AUTH_TYPES)}"
                " (Python's ssl cannot ask for a certificate without verifying it)",
            )
            return None
    if auth in VERIFYING and "client_ca_file" not in fields:
        problems.error(
            node.location,
            f"client_auth_type {auth} needs 'client_ca_file'",
            "add client_ca_file: the CA that signs the scrapers' certificates",
        )
    if auth not in VERIFYING and "client_ca_file" in fields:
        problems.error(
            node.location,
            "'client_ca_file' is set but client_auth_type is NoClientCert",
            "add client_auth_type: RequireAndVerifyClientCert (or remove client_ca_file)",
        )
    cert, key = files.get("cert_file"), files.get("key_file")
    if cert is None or key is None:
        return None
    return WebTls(cert=cert, key=key, client_ca=files.get("client_ca_file"), client_auth=auth)


def _load_users(node: Node, problems: Problems) -> tuple[tuple[str, str], ...]:
    fields = expect_mapping(node, problems, what="'basic_auth_users'")
    users = []
    for user, value in (fields or {}).items():
        what = f"the password hash of user {user!r}"
        if ":" in user:
            problems.error(
                node.keys[user],
                f"user name {user!r} holds ':', which basic auth cannot carry",
                "choose a name without ':'",
            )
            continue
        hashed = expect_str(value, problems, what=what)
        if hashed is None:
            continue
        if hashed.startswith("$2"):
            problems.error(
                value.location, f"{what} is a bcrypt hash, which drgate cannot check", HASH_HINT
            )
            continue
        try:
            argon2.extract_parameters(hashed)
        except argon2.exceptions.InvalidHashError:
            problems.error(value.location, f"{what} is not an argon2 hash", HASH_HINT)
            continue
        users.append((user, hashed))
    return tuple(users)
