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
"""

from __future__ import annotations

from pathlib import Path

from cluster.bus import BusConfig
from cluster.node import BrokerConfig
from filters.yamldoc import Node, Problems, check_keys, expect_int, expect_str, parse
from protocol.errors import ConfigError, Location, Problem

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
        optional=("amqp",),
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
                    if not Path(text_value).is_file():
                        problems.error(
                            value.location,
                            f"'amqp.tls.{key}' names {text_value!r}, which is not a file",
                            "give the path of a PEM file",
                        )
                    tls[key] = text_value
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
    )
