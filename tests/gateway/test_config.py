"""gateway/config.py: every mistake in a broker or sidecar config file is
reported with its file, line and column; a good file builds the frozen config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.addresses import Address
from cluster.bus import BusConfig
from cluster.bus.auth import write_key_file
from cluster.node import BrokerConfig
from cluster.tls import TlsFiles
from gateway.brokerconfig import load_broker_config
from gateway.cli import main
from gateway.config import load_sidecar_config
from gateway.linkconfig import LinkSettings
from gateway.sidecarconfig import SidecarConfig
from lab.site import LAB_RULES
from protocol.errors import ConfigError

BROKER = """\
cluster: site-p
node: 2
bus:
  backend: embedded
  group: site-p
  address: 127.0.0.1:7400
  key_file: bus.key
amqp:
  listen: 127.0.0.1:5673
"""


def sidecar(rules: Path = LAB_RULES) -> str:
    return f"""\
site: site-p
role: primary
node: 1
peer_cluster: site-d
peers: [10.0.1.1:7500, 10.0.1.2:7500]
bus:
  backend: corosync
spool:
  directory: /var/lib/drgate/spool
  max_bytes: 1048576
  fsync: always
rules: {rules}
metrics: 0.0.0.0:9464
insecure: true
"""


@pytest.fixture(autouse=True)
def bus_key(tmp_path: Path) -> Path:
    """The embedded bus's key file, beside the configs the tests write."""
    path = tmp_path / "bus.key"
    write_key_file(str(path))
    return path


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems_of(exc: ConfigError) -> list[str]:
    return [str(p) for p in exc.problems]


def assert_one_problem(
    load: Callable[[str], object], path: Path, line: int, column: int, words: list[str]
) -> None:
    """``load(path)`` raises ConfigError with one problem, at ``path:line:column``,
    whose text holds every one of ``words``."""
    with pytest.raises(ConfigError) as caught:
        load(str(path))
    found = problems_of(caught.value)
    assert len(found) == 1, found
    assert found[0].startswith(f"{path}:{line}:{column}: error: "), found
    for word in words:
        assert word in found[0]


# (case id, config text, line, column, words the message must contain)
BROKER_MISTAKES = [
    (
        "unknown key with nearest-key hint",
        BROKER.replace("  listen:", "  lisen:"),
        9,
        3,
        ["unknown key 'lisen' in 'amqp'", "did you mean 'listen'?"],
    ),
    (
        "unknown top-level key",
        BROKER + "clustr: x\n",
        10,
        1,
        ["unknown key 'clustr' in the broker config", "did you mean 'cluster'?"],
    ),
    (
        "wrong type",
        BROKER.replace("node: 2", "node: two"),
        2,
        7,
        ["'node' must be an integer, got a string"],
    ),
    (
        "out of range",
        BROKER.replace("node: 2", "node: 0"),
        2,
        7,
        ["'node' must be at least 1, got 0"],
    ),
    (
        "missing key",
        BROKER.replace("cluster: site-p\n", ""),
        1,
        1,
        ["missing key 'cluster' in the broker config"],
    ),
    (
        "bad HOST:PORT",
        BROKER.replace("127.0.0.1:5673", "localhost"),
        9,
        11,
        ["'amqp.listen' must be HOST:PORT, got 'localhost'", "for example 127.0.0.1:5672"],
    ),
    (
        "port out of range",
        BROKER.replace("127.0.0.1:7400", "127.0.0.1:99999"),
        6,
        12,
        ["'bus.address' must be HOST:PORT, got '127.0.0.1:99999'"],
    ),
    (
        "unknown bus backend",
        BROKER.replace("backend: embedded", "backend: zeromq"),
        4,
        12,
        ["unknown bus backend 'zeromq'", "use one of: embedded, corosync"],
    ),
    (
        "embedded bus without address",
        BROKER.replace("  address: 127.0.0.1:7400\n", ""),
        4,
        3,
        ["the embedded bus needs 'address'", "drgate bus --listen"],
    ),
    (
        "tls file missing",
        BROKER
        + "  tls:\n    cert: /nonexistent/broker.pem\n    key: /etc/hostname\n"
        + "    ca: /etc/hostname\n",
        11,
        11,
        ["'amqp.tls.cert' names '/nonexistent/broker.pem', which is not a file"],
    ),
    (
        "tls key missing from the mapping",
        BROKER + "  tls:\n    cert: /etc/hostname\n    ca: /etc/hostname\n",
        11,
        5,
        ["missing key 'key' in 'amqp.tls'"],
    ),
    (
        "negative checkpoint interval",
        BROKER.replace("  key_file:", "  expect_brokers: 3\n  key_file:")
        + "journal:\n  directory: j\n  checkpoint_interval_s: -5\n",
        13,
        26,
        ["'journal.checkpoint_interval_s' (0: checkpoint on bytes only) must be at least 0"],
    ),
    (
        "YAML syntax error",
        BROKER + "amqp: [\n",
        11,
        1,
        ["YAML syntax error"],
    ),
]


@pytest.mark.parametrize(
    ("text", "line", "column", "words"),
    [pytest.param(*case[1:], id=case[0]) for case in BROKER_MISTAKES],
)
def test_broker_config_mistakes_name_file_line_column(
    tmp_path: Path, text: str, line: int, column: int, words: list[str]
) -> None:
    path = write(tmp_path, "broker.yaml", text)
    assert_one_problem(load_broker_config, path, line, column, words)


def test_the_journal_checkpoint_interval_is_read_and_defaults_to_five_minutes(
    tmp_path: Path,
) -> None:
    journal = BROKER.replace("  key_file:", "  expect_brokers: 3\n  key_file:")
    journal += "journal:\n  directory: j\n"
    config = load_broker_config(str(write(tmp_path, "a.yaml", journal)))
    assert config.journal is not None and config.journal.checkpoint_interval_s == 300.0
    text = journal + "  checkpoint_interval_s: 60\n"
    config = load_broker_config(str(write(tmp_path, "b.yaml", text)))
    assert config.journal is not None and config.journal.checkpoint_interval_s == 60.0


def test_the_embedded_bus_needs_a_key_file(tmp_path: Path) -> None:
    path = write(tmp_path, "broker.yaml", BROKER.replace("  key_file: bus.key\n", ""))
    assert_one_problem(
        load_broker_config,
        path,
        4,
        3,
        ["the embedded bus needs 'key_file'", "drgate keygen --bus", "--key-file"],
    )


@pytest.mark.parametrize(
    ("prepare", "words"),
    [
        pytest.param(
            lambda key: key.chmod(0o640),
            ["has mode 0640: group or others may read or change", "chmod 0400"],
            id="group-readable",
        ),
        pytest.param(
            lambda key: key.chmod(0o604), ["has mode 0604", "chmod 0400"], id="world-readable"
        ),
        pytest.param(
            lambda key: key.unlink(),
            ["cannot read the bus key file", "No such file", "drgate keygen --bus"],
            id="absent",
        ),
        pytest.param(
            lambda key: (key.chmod(0o600), key.write_bytes(b"short")),
            ["holds 5 bytes, not 32 to 4096"],
            id="too-short",
        ),
    ],
)
def test_a_bus_key_file_that_cannot_be_used_is_reported_at_key_file(
    tmp_path: Path, bus_key: Path, prepare: Callable[[Path], object], words: list[str]
) -> None:
    prepare(bus_key)
    path = write(tmp_path, "broker.yaml", BROKER)
    assert_one_problem(load_broker_config, path, 7, 13, [str(bus_key), *words])


def test_a_corosync_bus_takes_no_key_file(tmp_path: Path) -> None:
    text = BROKER.replace("backend: embedded", "backend: corosync").replace(
        "  address: 127.0.0.1:7400\n", ""
    )
    path = write(tmp_path, "broker.yaml", text)
    assert_one_problem(
        load_broker_config, path, 6, 13, ["'bus.key_file' is for the embedded bus", "authkey"]
    )


COROSYNC_BROKER = (
    BROKER.replace("backend: embedded", "backend: corosync")
    .replace("  address: 127.0.0.1:7400\n", "")
    .replace("  key_file: bus.key\n", "")
)


def test_a_corosync_bus_names_the_namespace_its_daemon_serves(tmp_path: Path) -> None:
    text = COROSYNC_BROKER.replace("  group: site-p\n", "  group: site-p\n  netns: dgAn2\n")
    config = load_broker_config(write(tmp_path, "broker.yaml", text))
    assert config.bus is not None and config.bus.netns == "dgAn2"
    assert load_broker_config(write(tmp_path, "b2.yaml", COROSYNC_BROKER)).bus.netns is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param(
            BROKER.replace("  group: site-p\n", "  group: site-p\n  netns: dgAn2\n"),
            ["'bus.netns' is for the corosync backend", "remove netns"],
            id="embedded",
        ),
        pytest.param(
            COROSYNC_BROKER.replace("  group: site-p\n", "  group: site-p\n  netns: ../etc\n"),
            ["'../etc' is not a network namespace name", "ip netns list"],
            id="not-a-name",
        ),
    ],
)
def test_a_bad_bus_netns_is_reported_at_netns(tmp_path: Path, text: str, words: list[str]) -> None:
    assert_one_problem(load_broker_config, write(tmp_path, "broker.yaml", text), 6, 10, words)


def test_broker_config_reports_every_mistake_at_once_in_file_order(tmp_path: Path) -> None:
    text = BROKER.replace("node: 2", "node: two").replace("127.0.0.1:5673", "nowhere")
    path = write(tmp_path, "broker.yaml", text + "extra: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_broker_config(str(path))
    places = [(p.location.line, p.location.column) for p in caught.value.problems]
    assert places == [(2, 7), (9, 11), (10, 1)]


def test_an_unreadable_config_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as caught:
        load_broker_config(str(path))
    assert problems_of(caught.value) == [
        f"{path}:1:1: error: cannot read the file: No such file or directory"
    ]


def test_valid_broker_config_builds_the_frozen_object(tmp_path: Path) -> None:
    path = write(tmp_path, "broker.yaml", BROKER)
    config = load_broker_config(str(path))
    assert config == BrokerConfig(
        cluster="site-p",
        node=2,
        bus=BusConfig(
            backend="embedded",
            group="site-p",
            node=2,
            address=Address("127.0.0.1", 7400),
            key_file=str(tmp_path / "bus.key"),
        ),
        amqp=Address("127.0.0.1", 5673),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.node = 3  # type: ignore[misc]


def test_broker_config_defaults_and_tls(tmp_path: Path) -> None:
    pem = write(tmp_path, "x.pem", "not checked here")
    text = (
        f"cluster: c\nnode: 7\nbus: {{backend: corosync}}\n"
        f"amqp:\n  tls: {{cert: {pem}, key: {pem}, ca: {pem}}}\n"
    )
    config = load_broker_config("inline.yaml", text)
    assert config.bus == BusConfig(backend="corosync", group="drgate", node=7, address=None)
    assert config.amqp == Address("127.0.0.1", 5672)
    assert config.tls == TlsFiles(cert=str(pem), key=str(pem), ca=str(pem))


BAD_RULES = """\
version: 1
rules:
  - match: {queue: 'a*'}
    mode: full
default: {mode: from-args, fallback: none}
"""

# (case id, edit of the sidecar text, line, column, words)
SIDECAR_MISTAKES = [
    (
        "neither tls nor insecure",
        lambda t: t.replace("insecure: true\n", ""),
        1,
        1,
        [
            "the sidecar config has no 'tls': the link runs mutual TLS by default",
            "give tls: {cert, key, ca}, or insecure: true to run the link in plaintext",
        ],
    ),
    (
        "insecure false without tls",
        lambda t: t.replace("insecure: true", "insecure: false"),
        14,
        11,
        ["'insecure: false' without 'tls'", "or insecure: true to run the link in plaintext"],
    ),
    (
        "insecure not a bool",
        lambda t: t.replace("insecure: true", "insecure: yes please"),
        14,
        11,
        ["'insecure' must be true or false"],
    ),
    (
        "unknown key with nearest-key hint",
        lambda t: t + "metrcs: 1.2.3.4:5\n",
        15,
        1,
        ["unknown key 'metrcs' in the sidecar config", "did you mean 'metrics'?"],
    ),
    (
        "wrong type",
        lambda t: t.replace("max_bytes: 1048576", "max_bytes: [1]"),
        10,
        14,
        ["'spool.max_bytes' must be an integer, got a list"],
    ),
    (
        "missing key",
        lambda t: t.replace("peer_cluster: site-d\n", ""),
        1,
        1,
        ["missing key 'peer_cluster' in the sidecar config"],
    ),
    (
        "bad HOST:PORT in peers",
        lambda t: t.replace("10.0.1.2:7500", "nohost"),
        5,
        24,
        ["each item of 'peers' must be HOST:PORT, got 'nohost'"],
    ),
    (
        "bad HOST:PORT for metrics",
        lambda t: t.replace("0.0.0.0:9464", "0.0.0.0:http"),
        13,
        10,
        ["'metrics' must be HOST:PORT, got '0.0.0.0:http'"],
    ),
    (
        "unknown bus backend",
        lambda t: t.replace("backend: corosync", "backend: kafka"),
        7,
        12,
        ["unknown bus backend 'kafka'"],
    ),
    (
        "embedded bus without address",
        lambda t: t.replace("backend: corosync", "backend: embedded\n  key_file: bus.key"),
        7,
        3,
        ["the embedded bus needs 'address'"],
    ),
    (
        "unknown fsync policy",
        lambda t: t.replace("fsync: always", "fsync: sometimes"),
        11,
        10,
        ["unknown fsync policy 'sometimes'", "use one of: never, batch, always"],
    ),
    (
        "unknown role",
        lambda t: t.replace("role: primary", "role: master"),
        2,
        7,
        ["unknown role 'master'", "use primary or dr"],
    ),
    (
        "tls file missing",
        lambda t: t.replace(
            "insecure: true\n",
            "tls: {cert: /nonexistent.pem, key: /etc/hostname, ca: /etc/hostname}\n",
        ),
        14,
        13,
        ["'tls.cert' names '/nonexistent.pem', which is not a file"],
    ),
    (
        "primary without peers",
        lambda t: t.replace("peers: [10.0.1.1:7500, 10.0.1.2:7500]\n", ""),
        1,
        1,
        ["a primary sidecar needs 'peers'"],
    ),
    (
        "empty peers",
        lambda t: t.replace("[10.0.1.1:7500, 10.0.1.2:7500]", "[]"),
        5,
        8,
        ["'peers' must be a non-empty list of HOST:PORT"],
    ),
    (
        "dr without listen",
        lambda t: t.replace("role: primary", "role: dr").replace(
            "peers: [10.0.1.1:7500, 10.0.1.2:7500]\n", ""
        ),
        1,
        1,
        ["a dr sidecar needs 'listen'"],
    ),
]


@pytest.mark.parametrize(
    ("edit", "line", "column", "words"),
    [pytest.param(*case[1:], id=case[0]) for case in SIDECAR_MISTAKES],
)
def test_sidecar_config_mistakes_name_file_line_column(
    tmp_path: Path, edit: object, line: int, column: int, words: list[str]
) -> None:
    assert callable(edit)
    path = write(tmp_path, "sidecar.yaml", edit(sidecar()))
    assert_one_problem(load_sidecar_config, path, line, column, words)


def test_a_bad_rules_file_is_reported_with_its_own_lines(tmp_path: Path) -> None:
    rules = write(tmp_path, "rules.yaml", BAD_RULES)
    path = write(tmp_path, "sidecar.yaml", sidecar(rules))
    with pytest.raises(ConfigError) as caught:
        load_sidecar_config(str(path))
    found = problems_of(caught.value)
    assert found, found
    assert all(p.startswith(f"{rules}:") for p in found), found
    assert f"{rules}:4:5: error: unknown key 'mode' in a rule" in "\n".join(found)


def test_a_missing_rules_file_is_reported(tmp_path: Path) -> None:
    rules = tmp_path / "absent-rules.yaml"
    path = write(tmp_path, "sidecar.yaml", sidecar(rules))
    with pytest.raises(ConfigError) as caught:
        load_sidecar_config(str(path))
    assert problems_of(caught.value) == [
        f"{rules}:1:1: error: cannot read the file: No such file or directory"
    ]


def test_valid_sidecar_config_builds_the_frozen_object(tmp_path: Path) -> None:
    path = write(tmp_path, "sidecar.yaml", sidecar())
    config = load_sidecar_config(str(path))
    assert isinstance(config, SidecarConfig)
    expected = {
        "site": "site-p",
        "primary": True,
        "node": 1,
        "bus": BusConfig(backend="corosync", group="drgate", node=1, address=None),
        "peer_cluster": "site-d",
        "peers": (Address("10.0.1.1", 7500), Address("10.0.1.2", 7500)),
        "listen": None,
        "spool_dir": "/var/lib/drgate/spool",
        "spool_max_bytes": 1048576,
        "fsync": "always",
        "tls": None,
        "peer_names": ("site-d",),
        "metrics": Address("0.0.0.0", 9464),
        "metrics_web": None,
        "capture": None,
        "zombie_guard": "full",
        "link": LinkSettings(),
        "source": str(path),
    }
    got = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "rules"}
    assert got == expected
    assert config.rules is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.site = "other"  # type: ignore[misc]


def test_relative_paths_are_relative_to_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "etc"
    folder.mkdir()
    write(folder, "rules.yaml", LAB_RULES.read_text())
    for name in ("node.pem", "node.key", "ca.pem"):
        write(folder, name, "PEM")
    write_key_file(str(folder / "bus.key"))
    text = (
        "site: site-p\nrole: primary\nnode: 1\npeer_cluster: site-d\npeers: [127.0.0.1:7500]\n"
        "bus: {backend: embedded, address: 127.0.0.1:7401, key_file: bus.key}\n"
        "spool: {directory: spool}\nrules: rules.yaml\n"
        "tls: {cert: node.pem, key: node.key, ca: /etc/ssl/absolute-ca.pem}\n"
        "capture: {directory: capture}\n"
    )
    path = write(folder, "sidecar.yaml", text)
    monkeypatch.chdir(tmp_path)  # elsewhere: the working directory must not matter
    with pytest.raises(ConfigError) as caught:
        load_sidecar_config(str(path))
    # Only the absolute path is missing; the relative ones were found beside the file.
    assert [p.split(": error: ")[1] for p in problems_of(caught.value)] == [
        "'tls.ca' names '/etc/ssl/absolute-ca.pem', which is not a file"
        " (hint: give the path of a PEM file)"
    ]
    path.write_text(text.replace("/etc/ssl/absolute-ca.pem", "ca.pem"))
    config = load_sidecar_config(str(path))
    assert config.spool_dir == str(folder / "spool")
    assert config.bus.key_file == str(folder / "bus.key")
    assert config.rules.path == str(folder / "rules.yaml")
    assert config.tls == TlsFiles(
        cert=str(folder / "node.pem"), key=str(folder / "node.key"), ca=str(folder / "ca.pem")
    )
    assert config.capture is not None and config.capture.directory == str(folder / "capture")


def test_the_link_tls_pins_peer_names_defaulting_to_the_peer_cluster(tmp_path: Path) -> None:
    for name in ("node.pem", "node.key", "ca.pem"):
        write(tmp_path, name, "PEM")
    tls = "tls: {cert: node.pem, key: node.key, ca: ca.pem}\n"
    base = sidecar().replace("insecure: true\n", "")
    config = load_sidecar_config(str(write(tmp_path, "a.yaml", base + tls)))
    assert config.tls is not None
    assert config.peer_names == config.pinned_names == ("site-d",)
    pinned = tls.replace("}", ", peer_names: [d1.example, D2.example]}")
    config = load_sidecar_config(str(write(tmp_path, "b.yaml", base + pinned)))
    assert config.pinned_names == ("d1.example", "D2.example")
    for bad, words in (
        (tls.replace("}", ", peer_names: []}"), "'tls.peer_names' must be a non-empty list"),
        (tls + "insecure: true\n", "'insecure: true' and 'tls' both given"),
    ):
        with pytest.raises(ConfigError) as caught:
            load_sidecar_config(str(write(tmp_path, "c.yaml", base + bad)))
        assert len(caught.value.problems) == 1, problems_of(caught.value)
        assert words in problems_of(caught.value)[0]


def test_dr_sidecar_config_defaults(bus_key: Path) -> None:
    text = (
        f"site: site-d\nrole: dr\nnode: 2\npeer_cluster: site-p\nlisten: 0.0.0.0:7500\n"
        f"bus: {{backend: embedded, address: 127.0.0.1:7401, key_file: {bus_key}}}\n"
        f"spool: {{directory: /tmp/spool}}\nrules: {LAB_RULES}\ninsecure: true\n"
    )
    config = load_sidecar_config("d.yaml", text)
    assert not config.primary
    assert config.listen == Address("0.0.0.0", 7500)
    assert config.peers == ()
    assert (config.fsync, config.spool_max_bytes) == ("batch", 1 << 30)
    assert config.bus.address == Address("127.0.0.1", 7401)


@pytest.mark.parametrize("command", ["broker", "run"])
def test_commands_exit_1_with_the_messages_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    text = BROKER if command == "broker" else sidecar()
    bad = text.replace("backend: embedded", "backend: zeromq").replace(
        "backend: corosync", "backend: zeromq"
    )
    path = write(tmp_path, "bad.yaml", bad + "surplus: 1\n")
    assert main([command, "--config", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert lines[0].startswith(f"drgate {command}: {path}:")
    assert "unknown bus backend 'zeromq'" in captured.err
    assert "unknown key 'surplus'" in captured.err
    assert "Traceback" not in captured.err
    assert len(lines) == 2


def test_ipv6_addresses_in_brackets_are_typed_once(bus_key: Path) -> None:
    text = (
        "site: site-p\nrole: primary\nnode: 1\npeer_cluster: site-d\n"
        "peers: ['[::1]:7500', '[fd00::2]:7500']\nmetrics: '[::]:9464'\n"
        f"bus: {{backend: embedded, address: '[::1]:7401', key_file: {bus_key}}}\n"
        f"spool: {{directory: /tmp/spool}}\nrules: {LAB_RULES}\ninsecure: true\n"
    )
    config = load_sidecar_config("p.yaml", text)
    assert config.peers == (Address("::1", 7500), Address("fd00::2", 7500))
    assert config.metrics == Address("::", 9464)
    assert config.bus.address == Address("::1", 7401)


# ---------------------------------------------------------------------------
# The broker's AMQP security (cluster/amqpauth.py)
# ---------------------------------------------------------------------------


def test_broker_security_options_build_the_frozen_settings(tmp_path: Path) -> None:
    users = write(tmp_path, "users.json", '{"version": 1, "users": {"alice": {"hash": "h"}}}')
    text = BROKER.replace("127.0.0.1:5673", "10.0.0.1:5673") + (
        "  users: users.json\n  identities: {client-a: alice}\n"
        "  allow_plaintext: true\n  max_connections: 5\nmax_site_bytes: 4096\n"
    )
    config = load_broker_config(str(write(tmp_path, "broker.yaml", text)))
    assert config.security.users_file == str(users)
    assert config.security.users is not None and list(config.security.users) == ["alice"]
    assert config.security.identities == {"client-a": "alice"}
    assert (config.security.allow_plaintext, config.security.allow_anonymous) == (True, None)
    assert (config.security.max_connections, config.max_site_bytes) == (5, 4096)


SECURITY_MISTAKES = [
    (
        "non-loopback without tls",
        BROKER.replace("127.0.0.1:5673", "10.0.0.1:5673") + "  allow_anonymous: true\n",
        ["binds 10.0.0.1, not a loopback address, without 'amqp.tls'", "allow_plaintext: true"],
    ),
    (
        "users file missing",
        BROKER + "  users: /nonexistent/users.json\n",
        ["'amqp.users' names '/nonexistent/users.json'", "drgate admin user add"],
    ),
    (
        "allow_anonymous not a boolean",
        BROKER + "  allow_anonymous: sometimes\n",
        ["'amqp.allow_anonymous'", "true or false"],
    ),
    (
        "max_connections zero",
        BROKER + "  max_connections: 0\n",
        ["'amqp.max_connections' must be at least 1, got 0"],
    ),
    (
        "identities not a mapping",
        BROKER + "  identities: [a, b]\n",
        ["'amqp.identities'"],
    ),
    (
        "max_site_bytes not a number",
        BROKER + "max_site_bytes: lots\n",
        ["'max_site_bytes'", "integer"],
    ),
]


@pytest.mark.parametrize(
    ("text", "words"), [pytest.param(*case[1:], id=case[0]) for case in SECURITY_MISTAKES]
)
def test_broker_security_mistakes_name_the_key_and_the_fix(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_broker_config(str(write(tmp_path, "broker.yaml", text)))
    [problem] = problems_of(caught.value)
    assert all(word in problem for word in words), problem


def test_a_non_loopback_broker_needs_users_or_an_explicit_anonymous(tmp_path: Path) -> None:
    text = BROKER.replace("127.0.0.1:5673", "10.0.0.1:5673") + "  allow_plaintext: true\n"
    with pytest.raises(ConfigError) as caught:
        load_broker_config(str(write(tmp_path, "broker.yaml", text)))
    [problem] = problems_of(caught.value)
    assert "without 'amqp.users'" in problem and "allow_anonymous: true" in problem
    config = load_broker_config(
        str(write(tmp_path, "broker.yaml", text + "  allow_anonymous: true\n"))
    )
    assert config.security.allow_anonymous is True
