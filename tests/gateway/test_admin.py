"""``drgate admin``: the requests it builds (gateway/commands/admin.py), the bus
commands a broker makes of them (cluster/node.py ``admin_commands``), and one
run against a real 3-node site."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest

from cluster import state as st
from cluster.siteview import admin_commands
from gateway.cli import build_parser
from gateway.commands.admin import REPLICATE_ARGS, AdminError, request_for
from protocol import cluster as pc
from protocol.errors import DrgateError

BROKER = "amqp://127.0.0.1:5672"


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["admin", "--broker", BROKER, *argv])


# -- request_for ---------------------------------------------------------------------

REQUESTS = [
    (["add-queue", "q"], {"op": "add-queue", "name": "q", "args": {}}),
    (
        ["add-queue", "q", "--max-depth", "100", "--arg", "x-colour=blue", "--arg", "n=-3"],
        {
            "op": "add-queue",
            "name": "q",
            "args": {"qpid.max_count": 100, "x-colour": "blue", "n": -3},
        },
    ),
    (
        ["add-queue", "q", "--durable"],
        {"op": "add-queue", "name": "q", "args": {"durable": True}},
    ),
    (
        ["add-exchange", "fanout", "x", "--durable"],
        {"op": "add-exchange", "name": "x", "type": "fanout", "args": {"durable": True}},
    ),
    (["del-queue", "q"], {"op": "del-queue", "name": "q"}),
    (["purge", "q"], {"op": "purge", "name": "q"}),
    (
        ["add-exchange", "topic", "events", "--arg", "k=v"],
        {"op": "add-exchange", "name": "events", "type": "topic", "args": {"k": "v"}},
    ),
    (["del-exchange", "events"], {"op": "del-exchange", "name": "events"}),
    (
        ["bind", "events", "q", "orders.#"],
        {"op": "bind", "name": "events", "queue": "q", "key": "orders.#"},
    ),
    (["bind", "amq.fanout", "q"], {"op": "bind", "name": "amq.fanout", "queue": "q", "key": ""}),
    (
        ["unbind", "events", "q", "orders.#"],
        {"op": "unbind", "name": "events", "queue": "q", "key": "orders.#"},
    ),
]


@pytest.mark.parametrize(("argv", "expected"), REQUESTS, ids=[r[0][0] for r in REQUESTS])
def test_request_for_builds_the_json_request(argv: list[str], expected: dict[str, Any]) -> None:
    assert request_for(parse(*argv)) == expected


@pytest.mark.parametrize(
    ("mode", "args"),
    [
        ("full", {"qpid.replicate": "all", "qpid.queue_event_generation": 2}),
        ("enqueue", {"qpid.replicate": "all", "qpid.queue_event_generation": 1}),
        ("wiring", {"qpid.replicate": "configuration"}),
        ("none", {"qpid.replicate": "none"}),
    ],
)
def test_replicate_maps_to_qpid_arguments(mode: str, args: dict[str, Any]) -> None:
    assert REPLICATE_ARGS[mode] == args
    request = request_for(parse("add-queue", "q", "--replicate", mode))
    assert request["args"] == args


def test_replicate_wins_over_a_conflicting_arg() -> None:
    request = request_for(
        parse("add-queue", "q", "--arg", "qpid.replicate=none", "--replicate", "full")
    )
    assert request["args"]["qpid.replicate"] == "all"


def test_replicate_accepts_only_the_four_modes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("add-queue", "q", "--replicate", "everything")
    assert "invalid choice: 'everything'" in capsys.readouterr().err


@pytest.mark.parametrize("pair", ["novalue", "=v"])
def test_a_malformed_arg_is_an_admin_error(pair: str) -> None:
    with pytest.raises(AdminError, match="write it as KEY=VALUE"):
        request_for(parse("add-queue", "q", "--arg", pair))


def test_replicate_modes_are_valid_declares_for_the_state_machine() -> None:
    state = st.new_state()
    for mode in REPLICATE_ARGS:
        request = request_for(parse("add-queue", f"q-{mode}", "--replicate", mode))
        effects = st.apply_all(state, admin_commands(request))
        assert not [e for e in effects if isinstance(e, st.Refused)], effects
        assert st.queue_args(state, f"q-{mode}") == REPLICATE_ARGS[mode]


# -- admin_commands (the node side) ----------------------------------------------------

COMMANDS: list[tuple[dict[str, Any], list[Any]]] = [
    (
        {"op": "add-queue", "name": "q", "args": {"qpid.max_count": 5}},
        [pc.QueueDeclare("q", {"qpid.max_count": 5})],
    ),
    ({"op": "add-queue", "name": "q"}, [pc.QueueDeclare("q", {})]),
    ({"op": "del-queue", "name": "q"}, [pc.QueueDelete("q")]),
    ({"op": "purge", "name": "q"}, [pc.Purge("q")]),
    (
        {"op": "add-exchange", "name": "x", "type": "fanout", "args": {}},
        [pc.ExchangeDeclare("x", pc.ExchangeType.FANOUT, {})],
    ),
    ({"op": "add-exchange", "name": "x"}, [pc.ExchangeDeclare("x", pc.ExchangeType.DIRECT, {})]),
    ({"op": "del-exchange", "name": "x"}, [pc.ExchangeDelete("x")]),
    (
        {"op": "bind", "name": "x", "queue": "q", "key": "a.*"},
        [pc.Bind("x", "q", "a.*", {})],
    ),
    ({"op": "bind", "name": "x", "queue": "q"}, [pc.Bind("x", "q", "", {})]),
    ({"op": "unbind", "name": "x", "queue": "q", "key": "a.*"}, [pc.Unbind("x", "q", "a.*")]),
]


@pytest.mark.parametrize(
    ("request_", "expected"), COMMANDS, ids=[str(c[0]["op"]) for c in COMMANDS]
)
def test_admin_commands_for_each_op(request_: dict[str, Any], expected: list[Any]) -> None:
    assert admin_commands(request_) == expected


def test_admin_commands_round_trip_every_cli_request() -> None:
    for argv, _ in REQUESTS:
        commands = admin_commands(request_for(parse(*argv)))
        assert len(commands) == 1


def test_admin_commands_plain_values() -> None:
    class Symbol(str):
        pass

    (declare,) = admin_commands(
        {"op": "add-queue", "name": "q", "args": {Symbol("k"): Symbol("v"), "n": True}}
    )
    assert isinstance(declare, pc.QueueDeclare)
    assert declare.args == {"k": "v", "n": True}
    assert type(next(iter(declare.args))) is str
    assert type(declare.args["k"]) is str


def test_admin_commands_unknown_op_names_the_valid_ones() -> None:
    with pytest.raises(DrgateError) as caught:
        admin_commands({"op": "drop-everything", "name": "q"})
    assert str(caught.value) == (
        "unknown admin operation 'drop-everything'; valid: add-queue, del-queue, purge, "
        "add-exchange, del-exchange, bind, unbind"
    )


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        ({"name": "q"}, KeyError),  # no op
        ({"op": "bind", "name": "x"}, KeyError),  # no queue
        ({"op": "add-exchange", "name": "x", "type": "headers"}, KeyError),
    ],
)
def test_admin_commands_malformed_requests_raise_what_the_node_rejects(
    request_: dict[str, Any], error: type[Exception]
) -> None:
    # _on_admin turns ValueError, TypeError and KeyError into a rejection
    # "bad admin request: ..." (amqp:invalid-field).
    with pytest.raises(error):
        admin_commands(request_)


# -- against a real site ----------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # One site for the module's integration tests: starting one takes seconds.
    from lab.site import BrokerSite

    with BrokerSite("site-p", nodes=3, workdir=tmp_path_factory.mktemp("site")) as s:
        yield s


def queue_names(site: Any, node: int) -> set[str]:
    return {q["name"] for q in site.describe(node)["queues"]}


@pytest.mark.integration
@pytest.mark.slow
def test_admin_against_a_three_node_site(site: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # rich sizes the table to COLUMNS (80 without a terminal) and wraps cells.
    monkeypatch.setenv("COLUMNS", "200")
    done = site.admin(1, "add-queue", "orders", "--replicate", "full", "--max-depth", "50")
    assert done.returncode == 0, done.stderr
    assert "add-queue orders: done" in done.stdout
    assert site.admin(2, "add-exchange", "topic", "events").returncode == 0
    done = site.admin(3, "bind", "events", "orders", "orders.#")
    assert done.returncode == 0, done.stderr
    # Every node has the queue as soon as admin returned (settled after the bus).
    for node in site.node_ids:
        assert "orders" in queue_names(site, node)
    events = next(x for x in site.describe(2)["exchanges"] if x["name"] == "events")
    assert events["bindings"] == [{"queue": "orders", "key": "orders.#"}]

    published = site.client(
        1, "publish", site.amqp[1], "events", "--count", "3", "--subject", "orders.new"
    )
    assert published["accepted"] == 3, published

    brokers = [a for node in site.node_ids for a in ("--broker", site.amqp[node])]
    listing = site.admin(1, *brokers[2:], "queues")  # site.admin adds node 1's --broker
    assert listing.returncode == 0, listing.stderr
    rows = [line for line in listing.stdout.splitlines() if "orders" in line]
    assert len(rows) == 3, listing.stdout
    assert sorted(row.split("│")[1].strip() for row in rows) == ["1", "2", "3"]
    for row in rows:
        cells = [c.strip() for c in row.split("│")]
        assert cells[2:4] == ["orders", "3"]
        assert "qpid.replicate=all" in row
        assert "qpid.max_count=50" in row

    done = site.admin(2, "del-queue", "orders")
    assert done.returncode == 0, done.stderr
    for node in site.node_ids:
        assert "orders" not in queue_names(site, node)


@pytest.mark.integration
@pytest.mark.slow
def test_a_refused_admin_request_exits_1_with_the_reason(site: Any) -> None:
    done = site.admin(1, "del-exchange", "amq.direct")
    assert done.returncode == 1, done.stdout
    assert "Traceback" not in done.stderr
    assert "drgate admin:" in done.stderr
    assert "exchange 'amq.direct' is predeclared and cannot be deleted" in done.stderr
    gone = site.admin(1, "del-queue", "nowhere")
    assert gone.returncode == 1, gone.stdout
    assert "cannot delete queue 'nowhere': no such queue" in gone.stderr


@pytest.mark.integration
@pytest.mark.slow
def test_a_request_the_node_cannot_read_is_refused_with_the_reason(site: Any) -> None:
    from gateway.commands.admin import send_request

    with pytest.raises(AdminError) as caught:
        send_request(site.amqp[1], {"op": "frobnicate", "name": "q"})
    # Which broker refused which request, and the broker's own reason.
    assert f"{site.amqp[1]} refused frobnicate 'q'" in str(caught.value)
    assert "unknown admin operation 'frobnicate'" in str(caught.value)


@pytest.mark.integration
@pytest.mark.slow
def test_replicate_changes_a_running_queues_arguments_on_every_node(site: Any) -> None:
    assert site.admin(1, "add-queue", "audit", "--generate-queue-events", "1").returncode == 0
    done = site.drgate(1, "replicate", "audit", "configuration", "--broker", site.amqp[1])
    assert done.returncode == 0, done.stderr
    assert "mode wiring" in done.stdout
    for node in site.node_ids:
        audit = next(q for q in site.describe(node)["queues"] if q["name"] == "audit")
        assert audit["args"] == {
            "qpid.queue_event_generation": 1,
            "qpid.replicate": "configuration",
        }
    missing = site.drgate(2, "replicate", "nope", "all", "--broker", site.amqp[2])
    assert missing.returncode == 1
    assert f"{site.amqp[2]} has no queue 'nope'" in missing.stderr
