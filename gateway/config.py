"""Config files: YAML -> plain data -> frozen, typed objects built once at start-up.

Every mistake in a file is reported with file:line:column and a hint (via
:mod:`filters.yamldoc`); a bad file raises :class:`ConfigError` listing them
all, never a traceback.  The objects built here are the ones the layers
below take (``cluster.node.BrokerConfig``, ``cluster.bus.BusConfig``).

Broker config (``drgate broker --config FILE``)::

    cluster: site-p            # this site's cluster id
    node: 1                    # this node's id (corosync nodeid)
    bus:
      backend: embedded        # embedded | corosync
      group: drgate            # bus group name
      address: 127.0.0.1:7400  # embedded only: the sequencer
    amqp:
      listen: 0.0.0.0:5672
      tls:                     # optional: mutual TLS
        cert: /etc/drgate/broker.pem
        key: /etc/drgate/broker.key
        ca: /etc/drgate/ca.pem
    metrics: 0.0.0.0:9465      # optional: /metrics and /status (docs/observability.md)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cluster.bus import BusConfig
from cluster.node import BrokerConfig
from filters.yamldoc import Node, Problems, check_keys, expect_int, expect_str, parse
from gateway.capture import load_capture
from gateway.sidecar import SidecarConfig
from protocol.errors import ConfigError, Location, Problem, RulesError

BUS_BACKENDS = ("embedded", "corosync")
# The default group name: one site, one bus group.
DEFAULT_GROUP = "drgate"
DEFAULT_AMQP = "0.0.0.0:5672"


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


def parse_hostport(text: str, node: Node, problems: Problems, *, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        problems.error(
            node.location, f"{what} must be HOST:PORT, got {text!r}", "for example 127.0.0.1:5672"
        )
        return "", 0
    return host.strip("[]"), int(port)


def load_bus(node: Node, problems: Problems, *, node_id: int) -> BusConfig | None:
    fields = check_keys(
        node, problems, what="'bus'", required=("backend",), optional=("group", "address")
    )
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
        address = expect_str(fields["address"], problems, what="'bus.address'")
        if address is not None:
            parse_hostport(address, fields["address"], problems, what="'bus.address'")
    if backend == "embedded" and address is None and "address" not in fields:
        problems.error(
            node.location,
            "the embedded bus needs 'address' (the sequencer's HOST:PORT)",
            "start one with 'drgate bus --listen 127.0.0.1:7400' and add address: 127.0.0.1:7400",
        )
    if backend is None:
        return None
    return BusConfig(backend=backend, group=group, node=node_id, address=address)


def load_broker_config(path: str, text: str | None = None) -> BrokerConfig:
    """The broker config in ``path`` (or ``text``), or :class:`ConfigError`."""
    if text is None:
        text = read_text(path)
    problems = Problems()
    root = parse(text, path, error=ConfigError)
    fields = check_keys(
        root,
        problems,
        what="the broker config",
        required=("cluster", "node", "bus"),
        optional=("amqp", "metrics"),
    )
    if fields is None:
        problems.raise_if_any(ConfigError)
        raise AssertionError("unreachable")
    cluster = (
        expect_str(fields["cluster"], problems, what="'cluster'") if "cluster" in fields else None
    )
    node_id = (
        expect_int(fields["node"], problems, what="'node'", minimum=1, maximum=2**32 - 1)
        if "node" in fields
        else None
    )
    bus = load_bus(fields["bus"], problems, node_id=node_id or 0) if "bus" in fields else None
    host, port = "0.0.0.0", 5672
    tls: dict[str, str] = {}
    if "amqp" in fields:
        amqp = check_keys(fields["amqp"], problems, what="'amqp'", optional=("listen", "tls"))
        if amqp is not None and "listen" in amqp:
            listen = expect_str(amqp["listen"], problems, what="'amqp.listen'")
            if listen is not None:
                host, port = parse_hostport(listen, amqp["listen"], problems, what="'amqp.listen'")
        if amqp is not None and "tls" in amqp:
            tls_fields = check_keys(
                amqp["tls"], problems, what="'amqp.tls'", required=("cert", "key", "ca")
            )
            for key, value in (tls_fields or {}).items():
                text_value = expect_str(value, problems, what=f"'amqp.tls.{key}'")
                if text_value is not None:
                    text_value = beside(path, text_value)
                    if not Path(text_value).is_file():
                        problems.error(
                            value.location,
                            f"'amqp.tls.{key}' names {text_value!r}, which is not a file",
                            "give the path of a PEM file",
                        )
                    tls[key] = text_value
    metrics = None
    if "metrics" in fields:
        metrics = expect_str(fields["metrics"], problems, what="'metrics'")
        if metrics is not None:
            parse_hostport(metrics, fields["metrics"], problems, what="'metrics'")
    problems.raise_if_any(ConfigError)
    if cluster is None or node_id is None or bus is None:
        raise AssertionError("a missing value was not reported as a problem")
    return BrokerConfig(
        cluster=cluster,
        node=node_id,
        bus=bus,
        amqp_host=host,
        amqp_port=port,
        tls_cert=tls.get("cert"),
        tls_key=tls.get("key"),
        tls_ca=tls.get("ca"),
        metrics=metrics,
    )


# ---------------------------------------------------------------------------
# Sidecar config (drgate run --config FILE)
# ---------------------------------------------------------------------------

SIDECAR_KEYS_REQUIRED = ("site", "role", "node", "bus", "peer_cluster", "spool", "rules")
SIDECAR_KEYS_OPTIONAL = ("peers", "listen", "tls", "metrics", "capture")
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
        metrics: 0.0.0.0:9464
        tls: {cert: ..., key: ..., ca: ...}

    At D, ``listen: 0.0.0.0:7500`` instead of ``peers``.
    """
    from filters.rules import load_rules

    if text is None:
        text = read_text(path)
    problems = Problems()
    root = parse(text, path, error=ConfigError)
    fields = check_keys(
        root,
        problems,
        what="the sidecar config",
        required=SIDECAR_KEYS_REQUIRED,
        optional=SIDECAR_KEYS_OPTIONAL,
    )
    if fields is None:
        problems.raise_if_any(ConfigError)
        raise AssertionError("unreachable")

    def text_of(key: str) -> str | None:
        return expect_str(fields[key], problems, what=f"'{key}'") if key in fields else None

    site = text_of("site")
    role = text_of("role")
    if role is not None and role not in SITE_ROLES:
        problems.error(fields["role"].location, f"unknown role {role!r}", "use primary or dr")
    node_id = (
        expect_int(fields["node"], problems, what="'node'", minimum=1, maximum=2**32 - 1)
        if "node" in fields
        else None
    )
    bus = load_bus(fields["bus"], problems, node_id=node_id or 0) if "bus" in fields else None
    peer_cluster = text_of("peer_cluster")
    peers: list[str] = []
    if "peers" in fields:
        node = fields["peers"]
        if node.kind != "sequence" or not node.value:
            problems.error(node.location, "'peers' must be a non-empty list of HOST:PORT")
        else:
            for item in node.value:
                value = expect_str(item, problems, what="each item of 'peers'")
                if value is not None:
                    parse_hostport(value, item, problems, what="each item of 'peers'")
                    peers.append(value)
    listen = text_of("listen")
    if listen is not None:
        parse_hostport(listen, fields["listen"], problems, what="'listen'")
    if role == "primary" and not peers and "peers" not in fields:
        problems.error(root.location, "a primary sidecar needs 'peers' (D's sidecars, in order)")
    if role == "dr" and listen is None and "listen" not in fields:
        problems.error(root.location, "a dr sidecar needs 'listen' (HOST:PORT for the link)")
    spool_dir, spool_max, fsync = "", DEFAULT_SPOOL_MAX_BYTES, "batch"
    if "spool" in fields:
        spool = check_keys(
            fields["spool"],
            problems,
            what="'spool'",
            required=("directory",),
            optional=("max_bytes", "fsync"),
        )
        if spool is not None:
            if "directory" in spool:
                spool_dir = beside(
                    path,
                    expect_str(spool["directory"], problems, what="'spool.directory'") or "",
                )
            if "max_bytes" in spool:
                spool_max = (
                    expect_int(
                        spool["max_bytes"], problems, what="'spool.max_bytes'", minimum=1 << 16
                    )
                    or spool_max
                )
            if "fsync" in spool:
                fsync = expect_str(spool["fsync"], problems, what="'spool.fsync'") or fsync
                if fsync not in FSYNC_POLICIES:
                    problems.error(
                        spool["fsync"].location,
                        f"unknown fsync policy {fsync!r}",
                        f"use one of: {', '.join(FSYNC_POLICIES)}",
                    )
    rules = None
    rules_path = text_of("rules")
    if rules_path is not None:
        rules_path = beside(path, rules_path)
        try:
            rules = load_rules(read_text(rules_path), rules_path)
        except (RulesError, ConfigError) as exc:
            for problem in exc.problems:
                problems.items.append(problem)
    metrics = text_of("metrics")
    if metrics is not None:
        parse_hostport(metrics, fields["metrics"], problems, what="'metrics'")
    tls: dict[str, str] = {}
    if "tls" in fields:
        tls_fields = check_keys(
            fields["tls"], problems, what="'tls'", required=("cert", "key", "ca")
        )
        for key, tls_node in (tls_fields or {}).items():
            path_value = expect_str(tls_node, problems, what=f"'tls.{key}'")
            if path_value is not None:
                path_value = beside(path, path_value)
                if not Path(path_value).is_file():
                    problems.error(
                        tls_node.location, f"'tls.{key}' names {path_value!r}, which is not a file"
                    )
                tls[key] = path_value
    capture = load_capture(fields["capture"], problems) if "capture" in fields else None
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
        tls_cert=tls.get("cert"),
        tls_key=tls.get("key"),
        tls_ca=tls.get("ca"),
        metrics=metrics,
        capture=capture,
    )
