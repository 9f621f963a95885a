"""The broker's config file (``drgate broker --config``): the AMQP listener and
its users, the site's memory cap, the journal; the helpers it shares with the
sidecar's config are in gateway/config.py.

Example::

    cluster: site-p
    node: 1
    bus: {backend: corosync, group: drgate, expect_brokers: 3}
    amqp:
      listen: 10.0.0.1:5672    # default 127.0.0.1:5672
      tls: {cert: /etc/drgate/broker.pem, key: /etc/drgate/broker.key, ca: /etc/drgate/ca.pem}
      users: users.json        # optional: users and rights (drgate admin user add)
    max_site_bytes: 1073741824 # message bodies the site state may hold
    journal:                   # optional: durable brokers (docs/broker.md, "Durability")
      directory: /var/lib/drgate/journal
      fsync: batch             # batch (default) | never
    metrics: 127.0.0.1:9465
"""

from __future__ import annotations

from cluster.addresses import Address
from cluster.amqpauth import (
    DEFAULT_MAX_CONNECTIONS,
    AmqpSecurity,
    User,
    listener_problems,
    load_users,
)
from cluster.durability import JournalSettings
from cluster.journal import DEFAULT_CHECKPOINT_INTERVAL_S
from cluster.node import DEFAULT_MAX_SITE_BYTES, BrokerConfig
from filters.yamldoc import (
    Node,
    Problems,
    check_keys,
    expect_bool,
    expect_int,
    expect_mapping,
    expect_str,
)
from gateway.config import (
    DEFAULT_BROKER_METRICS,
    beside,
    load_address,
    load_bus,
    load_metrics,
    load_node_id,
    load_tls,
    read_top_level,
)
from protocol.errors import ConfigError

# Loopback, the AMQP port: serving the network is the operator's decision,
# with TLS and users (or explicit opt-outs, see cluster.amqpauth).
DEFAULT_AMQP = Address("127.0.0.1", 5672)
AMQP_KEYS = (
    "listen",
    "tls",
    "users",
    "identities",
    "allow_anonymous",
    "allow_plaintext",
    "max_connections",
)


def load_broker_config(path: str, text: str | None = None) -> BrokerConfig:
    """The broker config in ``path`` (or ``text``), or :class:`ConfigError`."""
    problems, _, fields = read_top_level(
        path,
        text,
        what="the broker config",
        required=("cluster", "node", "bus"),
        optional=("amqp", "metrics", "max_site_bytes", "journal"),
    )
    cluster = (
        expect_str(fields["cluster"], problems, what="'cluster'") if "cluster" in fields else None
    )
    node_id = load_node_id(fields, problems)
    bus = (
        load_bus(fields["bus"], problems, path=path, node_id=node_id or 0)
        if "bus" in fields
        else None
    )
    amqp_listen, tls, security = DEFAULT_AMQP, None, AmqpSecurity()
    amqp: dict[str, Node] = {}
    if "amqp" in fields:
        amqp = check_keys(fields["amqp"], problems, what="'amqp'", optional=AMQP_KEYS) or {}
    if "listen" in amqp:
        amqp_listen = load_address(amqp["listen"], problems, what="'amqp.listen'") or amqp_listen
    if "tls" in amqp:
        tls = load_tls(amqp["tls"], problems, path=path, key="amqp.tls")
    if "amqp" in fields:
        security = load_security(amqp, problems, path=path)
        for problem, fix in listener_problems(
            amqp_listen.host, tls="tls" in amqp, security=security
        ):
            problems.error(fields["amqp"].location, problem, fix)
    max_site_bytes = DEFAULT_MAX_SITE_BYTES
    if "max_site_bytes" in fields:
        max_site_bytes = (
            expect_int(fields["max_site_bytes"], problems, what="'max_site_bytes'", minimum=1)
            or max_site_bytes
        )
    metrics, metrics_web = None, None
    if "metrics" in fields:
        metrics, metrics_web = load_metrics(
            fields["metrics"], problems, path=path, default=DEFAULT_BROKER_METRICS
        )
    journal = _load_journal(fields["journal"], problems, path=path) if "journal" in fields else None
    if journal is not None and bus is not None and bus.expect_brokers == 0:
        problems.error(
            fields["journal"].location,
            "a broker with a journal needs 'bus.expect_brokers' (the site's number of brokers)",
            "add expect_brokers: N under bus, the same in every config of the site, so that a "
            "site restarted whole waits for its brokers' journals",
        )
    problems.raise_if_any(ConfigError)
    if cluster is None or node_id is None or bus is None:
        raise AssertionError("a missing value was not reported as a problem")
    return BrokerConfig(
        cluster=cluster,
        node=node_id,
        bus=bus,
        amqp=amqp_listen,
        tls=tls,
        metrics=metrics,
        metrics_web=metrics_web,
        security=security,
        max_site_bytes=max_site_bytes,
        journal=journal,
    )


def load_security(amqp: dict[str, Node], problems: Problems, *, path: str) -> AmqpSecurity:
    """Users, rights and limits of the ``amqp`` mapping (cluster.amqpauth)."""
    users: dict[str, User] | None = None
    users_file = ""
    if "users" in amqp:
        users_file = beside(path, expect_str(amqp["users"], problems, what="'amqp.users'") or "")
        if users_file:
            try:
                users = load_users(users_file)
            except ConfigError as exc:
                for problem in exc.problems:
                    problems.error(
                        amqp["users"].location,
                        f"'amqp.users' names {users_file!r}: {problem.message}",
                        problem.hint,
                    )
    flags: dict[str, bool | None] = {}
    for key in ("allow_anonymous", "allow_plaintext"):
        if key in amqp:
            flags[key] = expect_bool(amqp[key], problems, what=f"'amqp.{key}'")
    identities: dict[str, str] = {}
    for name, node in (
        expect_mapping(amqp["identities"], problems, what="'amqp.identities'") or {}
        if "identities" in amqp
        else {}
    ).items():
        user = expect_str(node, problems, what=f"'amqp.identities.{name}'")
        if user:
            identities[name] = user
    max_connections = DEFAULT_MAX_CONNECTIONS
    if "max_connections" in amqp:
        max_connections = (
            expect_int(amqp["max_connections"], problems, what="'amqp.max_connections'", minimum=1)
            or max_connections
        )
    return AmqpSecurity(
        users=users,
        users_file=users_file,
        allow_anonymous=flags.get("allow_anonymous"),
        allow_plaintext=bool(flags.get("allow_plaintext")),
        identities=identities,
        max_connections=max_connections,
    )


def _load_journal(node: Node, problems: Problems, *, path: str) -> JournalSettings | None:
    """``journal``: {directory, fsync: batch | never, checkpoint_bytes,
    checkpoint_interval_s}."""
    fields = check_keys(
        node,
        problems,
        what="'journal'",
        required=("directory",),
        optional=("fsync", "checkpoint_bytes", "checkpoint_interval_s"),
    )
    if fields is None or "directory" not in fields:
        return None
    directory = beside(
        path, expect_str(fields["directory"], problems, what="'journal.directory'") or ""
    )
    fsync = "batch"
    if "fsync" in fields:
        fsync = expect_str(fields["fsync"], problems, what="'journal.fsync'") or fsync
        if fsync not in ("batch", "never"):
            problems.error(
                fields["fsync"].location,
                f"unknown journal fsync policy {fsync!r}",
                "use batch (one fdatasync per group of frames: nothing settled is lost in a "
                "power cut) or never (a crashed process loses nothing, a crashed machine may)",
            )
    checkpoint_bytes = 64 << 20
    if "checkpoint_bytes" in fields:
        checkpoint_bytes = (
            expect_int(
                fields["checkpoint_bytes"],
                problems,
                what="'journal.checkpoint_bytes'",
                minimum=1 << 16,
            )
            or checkpoint_bytes
        )
    interval_s = DEFAULT_CHECKPOINT_INTERVAL_S
    if "checkpoint_interval_s" in fields:
        seconds = expect_int(
            fields["checkpoint_interval_s"],
            problems,
            what="'journal.checkpoint_interval_s' (0: checkpoint on bytes only)",
            minimum=0,
        )
        interval_s = interval_s if seconds is None else float(seconds)
    return JournalSettings(directory, fsync, checkpoint_bytes, interval_s)
