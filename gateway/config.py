"""Config files: YAML -> plain data -> frozen, typed objects built once at start-up.

Every mistake in a file is reported with file:line:column and a hint (via
:mod:`filters.yamldoc`); a bad file raises :class:`ConfigError` listing them
all, never a traceback.  The objects built here are the ones the layers
below take (``cluster.node.BrokerConfig``, ``cluster.bus.BusConfig``).

The broker's config is read in gateway/brokerconfig.py, with these helpers.

``metrics: HOST:PORT`` is short for ``metrics: {listen: HOST:PORT}``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from cluster.addresses import Address, parse_address
from cluster.bus import BusConfig
from cluster.bus.auth import bus_key_problem
from cluster.tls import TlsFiles
from cluster.webconfig import WebConfig
from filters.matcher import RuleSet
from filters.yamldoc import (
    Node,
    Problems,
    check_keys,
    expect_bool,
    expect_int,
    expect_str,
    parse,
)
from gateway.capture import load_capture
from gateway.linkconfig import LinkSettings, load_link_settings
from gateway.sidecarconfig import SidecarConfig
from gateway.webconfig import load_web_config
from protocol.errors import ConfigError, Location, Problem, RulesError

BUS_BACKENDS = ("embedded", "corosync")
# The default group name: one site, one bus group.
DEFAULT_GROUP = "drgate"
NETNS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # as `ip netns add` takes it
# /metrics and /status: loopback unless the config says otherwise, since they
# tell whoever asks the site's topology, queues and lag; a broker and its
# sidecar on one host need two ports.
DEFAULT_BROKER_METRICS = Address("127.0.0.1", 9465)
DEFAULT_SIDECAR_METRICS = Address("127.0.0.1", 9464)


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            [Problem(Location(path, 1, 1), f"cannot read the file: {exc.strerror}")]
        ) from exc


def beside(config_path: str, value: str) -> str:
    """A path named in a config file: relative paths are relative to the
    folder of that file (as an operator reads them), absolute ones stay.
    A config given as text (no file) leaves them relative to the working
    directory."""
    if not value or Path(value).is_absolute() or not Path(config_path).is_file():
        return value
    return str(Path(config_path).resolve().parent / value)


def read_top_level(
    path: str,
    text: str | None,
    *,
    what: str,
    required: tuple[str, ...],
    optional: tuple[str, ...],
) -> tuple[Problems, Node, dict[str, Node]]:
    """The config in ``path`` (or ``text``) parsed: the problems found so far,
    the root and its top-level keys.  Raises :class:`ConfigError` when the
    file cannot be read or its top level is not a mapping of known keys."""
    if text is None:
        text = read_text(path)
    problems = Problems()
    root = parse(text, path, error=ConfigError)
    fields = check_keys(root, problems, what=what, required=required, optional=optional)
    if fields is None:
        problems.raise_if_any(ConfigError)
        raise AssertionError("unreachable")
    return problems, root, fields


def load_node_id(fields: dict[str, Node], problems: Problems) -> int | None:
    """``node``: the corosync nodeid, a u32 other than 0."""
    if "node" not in fields:
        return None
    return expect_int(fields["node"], problems, what="'node'", minimum=1, maximum=2**32 - 1)


def load_address(node: Node, problems: Problems, *, what: str) -> Address | None:
    """The ``HOST:PORT`` at ``node`` (:func:`cluster.addresses.parse_address`),
    or None with the mistake added to ``problems``."""
    text = expect_str(node, problems, what=what)
    if text is None:
        return None
    try:
        return parse_address(text, key=what, location=node.location)
    except ConfigError as exc:
        problems.items.extend(exc.problems)
        return None


def load_tls(
    node: Node, problems: Problems, *, path: str, key: str, optional: tuple[str, ...] = ()
) -> TlsFiles | None:
    """The ``{cert, key, ca}`` mapping at config key ``key``: each a PEM file,
    relative to the config file ``path``; None with the mistakes added to
    ``problems``.  Keys in ``optional`` are allowed and left to the caller."""
    fields = check_keys(
        node, problems, what=f"'{key}'", required=("cert", "key", "ca"), optional=optional
    )
    files: dict[str, str] = {}
    for name, value in (fields or {}).items():
        if name in optional:
            continue
        text = expect_str(value, problems, what=f"'{key}.{name}'")
        if text is None:
            continue
        files[name] = beside(path, text)
        if not Path(files[name]).is_file():
            problems.error(
                value.location,
                f"'{key}.{name}' names {files[name]!r}, which is not a file",
                "give the path of a PEM file",
            )
    if set(files) != {"cert", "key", "ca"}:
        return None
    return TlsFiles(cert=files["cert"], key=files["key"], ca=files["ca"])


def load_metrics(
    node: Node, problems: Problems, *, path: str, default: Address
) -> tuple[Address | None, WebConfig | None]:
    """``metrics``: ``HOST:PORT``, or ``{listen: HOST:PORT, web_config: FILE}``
    with ``listen`` defaulting to ``default`` (loopback).  The web config
    file is relative to the config file ``path``."""
    if node.kind == "scalar":
        return load_address(node, problems, what="'metrics'"), None
    fields = check_keys(node, problems, what="'metrics'", optional=("listen", "web_config"))
    if fields is None:
        return None, None
    listen: Address | None = default
    if "listen" in fields:
        listen = load_address(fields["listen"], problems, what="'metrics.listen'")
    web = None
    if "web_config" in fields:
        web_path = expect_str(fields["web_config"], problems, what="'metrics.web_config'")
        if web_path is not None:
            web = load_web_config(
                beside(path, web_path),
                problems,
                key="'metrics.web_config'",
                location=fields["web_config"].location,
            )
    return listen, web


def load_bus(node: Node, problems: Problems, *, path: str, node_id: int) -> BusConfig | None:
    """``bus``; the embedded bus's ``key_file`` is relative to the config file ``path``."""
    optional = ("group", "address", "key_file", "expect_brokers", "netns")
    fields = check_keys(node, problems, what="'bus'", required=("backend",), optional=optional)
    if fields is None:
        return None
    backend = (
        expect_str(fields["backend"], problems, what="'bus.backend'")
        if "backend" in fields
        else None
    )
    if backend is not None and backend not in BUS_BACKENDS:
        problems.error(
            fields["backend"].location,
            f"unknown bus backend {backend!r}",
            f"use one of: {', '.join(BUS_BACKENDS)}",
        )
        backend = None
    group = DEFAULT_GROUP
    if "group" in fields:
        group = expect_str(fields["group"], problems, what="'bus.group'") or DEFAULT_GROUP
    address = None
    if "address" in fields:
        address = load_address(fields["address"], problems, what="'bus.address'")
    if backend == "embedded" and address is None and "address" not in fields:
        problems.error(
            node.location,
            "the embedded bus needs 'address' (the sequencer's HOST:PORT)",
            "start one with 'drgate bus --listen 127.0.0.1:7400 --group NAME --key-file bus.key' "
            "and add address: 127.0.0.1:7400",
        )
    key_file = None
    if "key_file" in fields:
        text = expect_str(fields["key_file"], problems, what="'bus.key_file'")
        key_file = beside(path, text) if text else None
    if backend is not None and (problem := bus_key_problem(backend, key_file)) is not None:
        problems.error(fields.get("key_file", node).location, *problem)
    expect_brokers = 0
    if "expect_brokers" in fields:
        expect_brokers = (
            expect_int(fields["expect_brokers"], problems, what="'bus.expect_brokers'", minimum=0)
            or 0
        )
    netns = None
    if "netns" in fields:
        netns = expect_str(fields["netns"], problems, what="'bus.netns'")
        if backend == "embedded":
            problems.error(
                fields["netns"].location,
                "'bus.netns' is for the corosync backend (the namespace its daemon serves)",
                "remove netns: the embedded bus is reached by its address",
            )
        elif netns is not None and not NETNS_NAME.fullmatch(netns):
            problems.error(
                fields["netns"].location,
                f"'bus.netns' {netns!r} is not a network namespace name",
                "give the name 'ip netns list' shows (letters, digits, '.', '_', '-')",
            )
    if backend is None:
        return None
    return BusConfig(
        backend,
        group,
        node_id,
        address,
        key_file if backend == "embedded" else None,
        expect_brokers,
        netns if backend == "corosync" else None,
    )


# ---------------------------------------------------------------------------
# Sidecar config (drgate run --config FILE)
# ---------------------------------------------------------------------------

SIDECAR_KEYS_REQUIRED = ("site", "role", "node", "bus", "peer_cluster", "spool", "rules")
SIDECAR_KEYS_OPTIONAL = (
    "peers",
    "listen",
    "tls",
    "insecure",
    "metrics",
    "capture",
    "zombie_guard",
    "link",
)
# Which queues a primary refuses publishes to once D was promoted over it.
ZOMBIE_GUARDS = ("full", "replicated", "off")
SITE_ROLES = ("primary", "dr")
FSYNC_POLICIES = ("never", "batch", "always")
# 1 GiB: at 200-byte events, about five million events, minutes of a busy
# site's traffic, before D needs a resync.
DEFAULT_SPOOL_MAX_BYTES = 1 << 30


def load_sidecar_config(path: str, text: str | None = None) -> SidecarConfig:
    """The sidecar config in ``path`` (or ``text``), or :class:`ConfigError`.

    Example (P)::

        site: site-p
        role: primary            # primary (tap + egress) | dr (ingress)
        node: 1
        peer_cluster: site-d
        peers: [10.0.1.1:7500, 10.0.1.2:7500, 10.0.1.3:7500]   # D's sidecars, in order
        bus: {backend: corosync, group: drgate}
        spool: {directory: /var/lib/drgate/spool, max_bytes: 1073741824, fsync: batch}
        rules: /etc/drgate/rules.yaml
        metrics: 127.0.0.1:9464  # or {listen: ..., web_config: ...}
        tls: {cert: ..., key: ..., ca: ..., peer_names: [site-d]}
        zombie_guard: full       # full (default) | replicated | off
        link: {ack_events: 256, ack_ms: 20, window_bytes: 8388608, linger_ms: 0,
               heartbeat_ms: 5000, heartbeat_timeout_ms: 15000}   # the defaults

    At D, ``listen: 0.0.0.0:7500`` instead of ``peers``.  The link runs
    mutual TLS: ``tls`` is required unless ``insecure: true`` (plaintext,
    warned about at start); ``tls.peer_names`` pins the names the peer's
    certificate may carry (default: ``peer_cluster``).
    """
    problems, root, fields = read_top_level(
        path,
        text,
        what="the sidecar config",
        required=SIDECAR_KEYS_REQUIRED,
        optional=SIDECAR_KEYS_OPTIONAL,
    )

    def text_of(key: str) -> str | None:
        return expect_str(fields[key], problems, what=f"'{key}'") if key in fields else None

    site = text_of("site")
    role = text_of("role")
    if role is not None and role not in SITE_ROLES:
        problems.error(fields["role"].location, f"unknown role {role!r}", "use primary or dr")
    node_id = load_node_id(fields, problems)
    bus = (
        load_bus(fields["bus"], problems, path=path, node_id=node_id or 0)
        if "bus" in fields
        else None
    )
    peer_cluster = text_of("peer_cluster")
    peers = _load_peers(fields["peers"], problems) if "peers" in fields else []
    listen = (
        load_address(fields["listen"], problems, what="'listen'") if "listen" in fields else None
    )
    if role == "primary" and not peers and "peers" not in fields:
        problems.error(root.location, "a primary sidecar needs 'peers' (D's sidecars, in order)")
    if role == "dr" and listen is None and "listen" not in fields:
        problems.error(root.location, "a dr sidecar needs 'listen' (HOST:PORT for the link)")
    spool_dir, spool_max, fsync = "", DEFAULT_SPOOL_MAX_BYTES, "batch"
    if "spool" in fields:
        spool_dir, spool_max, fsync = _load_spool(fields["spool"], problems, path=path)
    rules_path = text_of("rules")
    rules = None if rules_path is None else _load_rules(beside(path, rules_path), problems)
    metrics, metrics_web = None, None
    if "metrics" in fields:
        metrics, metrics_web = load_metrics(
            fields["metrics"], problems, path=path, default=DEFAULT_SIDECAR_METRICS
        )
    tls, peer_names = _load_link_security(root, fields, problems, path=path)
    capture = load_capture(fields["capture"], problems) if "capture" in fields else None
    link = load_link_settings(fields["link"], problems) if "link" in fields else LinkSettings()
    zombie_guard = text_of("zombie_guard") or "full"
    if zombie_guard not in ZOMBIE_GUARDS:
        problems.error(
            fields["zombie_guard"].location,
            f"unknown zombie_guard {zombie_guard!r}",
            "use full (refuse publishes to full queues once D was promoted), replicated "
            "(every replicated queue) or off",
        )
    if capture is not None:
        capture = dataclasses.replace(capture, directory=beside(path, capture.directory))
    problems.raise_if_any(ConfigError)
    if site is None or role is None or node_id is None or bus is None or rules is None:
        raise AssertionError("a missing value was not reported as a problem")
    return SidecarConfig(
        site=site,
        primary=role == "primary",
        node=node_id,
        bus=bus,
        peer_cluster=peer_cluster or "",
        peers=tuple(peers),
        listen=listen,
        spool_dir=spool_dir,
        spool_max_bytes=spool_max,
        fsync=fsync,
        rules=rules,
        tls=tls,
        peer_names=peer_names or (peer_cluster or "",),
        metrics=metrics,
        metrics_web=metrics_web,
        capture=capture,
        zombie_guard=zombie_guard,
        link=link,
        source=str(path),
    )


def _load_link_security(
    root: Node, fields: dict[str, Node], problems: Problems, *, path: str
) -> tuple[TlsFiles | None, tuple[str, ...]]:
    """``tls`` (with ``peer_names``) or ``insecure: true``: exactly one of them."""
    insecure: bool | None = False
    if "insecure" in fields:
        insecure = expect_bool(fields["insecure"], problems, what="'insecure'")
    if "tls" not in fields:
        if insecure is None:  # not a bool: reported
            pass
        elif not insecure and "insecure" not in fields:
            problems.error(
                root.location,
                "the sidecar config has no 'tls': the link runs mutual TLS by default",
                "give tls: {cert, key, ca}, or insecure: true to run the link in plaintext",
            )
        elif not insecure:
            problems.error(
                fields["insecure"].location,
                "'insecure: false' without 'tls': the link has no certificates",
                "give tls: {cert, key, ca}, or insecure: true to run the link in plaintext",
            )
        return None, ()
    if insecure:
        problems.error(
            fields["insecure"].location,
            "'insecure: true' and 'tls' both given: the link cannot be plaintext and TLS",
            "remove 'insecure' to run the link with mutual TLS",
        )
    node = fields["tls"]
    tls = load_tls(node, problems, path=path, key="tls", optional=("peer_names",))
    names: list[str] = []
    if node.kind == "mapping" and "peer_names" in node.value:
        listed = node.value["peer_names"]
        if listed.kind != "sequence" or not listed.value:
            problems.error(
                listed.location,
                "'tls.peer_names' must be a non-empty list of certificate names",
                "e.g. peer_names: [site-d] (default: the peer_cluster)",
            )
        else:
            for item in listed.value:
                name = expect_str(item, problems, what="each item of 'tls.peer_names'")
                if name is not None:
                    names.append(name)
    return tls, tuple(names)


def _load_peers(node: Node, problems: Problems) -> list[Address]:
    """``peers``: D's sidecars, in the order the egress tries them."""
    if node.kind != "sequence" or not node.value:
        problems.error(node.location, "'peers' must be a non-empty list of HOST:PORT")
        return []
    peers = [load_address(item, problems, what="each item of 'peers'") for item in node.value]
    return [peer for peer in peers if peer is not None]


def _load_spool(node: Node, problems: Problems, *, path: str) -> tuple[str, int, str]:
    """``spool``: (directory, max_bytes, fsync policy)."""
    directory, max_bytes, fsync = "", DEFAULT_SPOOL_MAX_BYTES, "batch"
    spool = check_keys(
        node, problems, what="'spool'", required=("directory",), optional=("max_bytes", "fsync")
    )
    if spool is None:
        return directory, max_bytes, fsync
    if "directory" in spool:
        text = expect_str(spool["directory"], problems, what="'spool.directory'") or ""
        directory = beside(path, text)
    if "max_bytes" in spool:
        what = "'spool.max_bytes'"
        max_bytes = (
            expect_int(spool["max_bytes"], problems, what=what, minimum=1 << 16) or max_bytes
        )
    if "fsync" in spool:
        fsync = expect_str(spool["fsync"], problems, what="'spool.fsync'") or fsync
        if fsync not in FSYNC_POLICIES:
            problems.error(
                spool["fsync"].location,
                f"unknown fsync policy {fsync!r}",
                f"use one of: {', '.join(FSYNC_POLICIES)}",
            )
    return directory, max_bytes, fsync


def _load_rules(rules_path: str, problems: Problems) -> RuleSet | None:
    """The rules file, its problems added to ``problems``."""
    from filters.rules import load_rules

    try:
        return load_rules(read_text(rules_path), rules_path)
    except (RulesError, ConfigError) as exc:
        problems.items.extend(exc.problems)
        return None
