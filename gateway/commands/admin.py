"""``drgate admin``: declare, delete and list queues, exchanges and bindings.

The counterpart of Qpid's ``qpid-config``.  It talks AMQP 1.0 to a broker:
requests go as JSON messages to the broker's ``$drgate.admin`` address and are
settled once the change has come back on the site bus (so every broker has
it); listings come from ``$drgate.queues``.  ``--replicate`` and
``--generate-queue-events`` set the Qpid queue arguments that the rules'
``from-args`` mode reads (:func:`replication_args`).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
from typing import Any

from rich.console import Console
from rich.table import Table

from gateway.commands._users import configure_user, run_user
from protocol.errors import DrgateError
from protocol.modes import (
    DURABLE_ARG,
    EVENT_GENERATION_ARG,
    EVENT_GENERATION_VALUES,
    REPLICATE_ARG,
    REPLICATE_VALUES,
    Mode,
    declare_args,
)

NAME = "admin"
HELP = "declare, delete and list queues, exchanges and bindings (like qpid-config)"
TIMEOUT_S = 30.0
# Where --user's password is read from when set (else it is prompted).
PASSWORD_ENV = "DRGATE_PASSWORD"

REPLICATE_ARGS: dict[str, dict[str, Any]] = {mode.label: declare_args(mode) for mode in Mode}
"""``--replicate`` label -> the queue arguments that ask for that mode."""
REPLICATE_CHOICES = tuple(sorted(set(REPLICATE_ARGS) | set(REPLICATE_VALUES)))
"""drgate's mode labels and qpid-config's ``qpid.replicate`` values (``none`` is both)."""
REPLICATE_HELP = (
    "full | enqueue | wiring | none (drgate's modes), or all | configuration | none "
    "(qpid-config's values: qpid.replicate=VALUE)"
)


class AdminError(DrgateError):
    """The broker refused a request or could not be reached."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker",
        action="append",
        metavar="URL",
        help="broker URL, e.g. amqp://127.0.0.1:5672 (repeat to list several nodes); "
        "required by every operation but 'user'",
    )
    parser.add_argument(
        "--user",
        metavar="NAME",
        help=f"authenticate with SASL PLAIN as NAME (password from ${PASSWORD_ENV} or a prompt)",
    )
    sub = parser.add_subparsers(dest="op", required=True, metavar="OP")
    add = sub.add_parser("add-queue", help="declare a queue")
    add.add_argument("name")
    add.add_argument("--replicate", choices=REPLICATE_CHOICES, metavar="MODE", help=REPLICATE_HELP)
    add.add_argument(
        "--generate-queue-events",
        type=int,
        choices=EVENT_GENERATION_VALUES,
        metavar="N",
        help="as qpid-config: 1 replicates enqueues (mode enqueue), 2 enqueues and dequeues "
        "(mode full); sets qpid.queue_event_generation=N",
    )
    add.add_argument("--max-depth", type=int, help="refuse publishes beyond this many messages")
    add.add_argument("--arg", action="append", default=[], metavar="K=V", help="queue argument")
    add.add_argument(
        "--durable",
        action="store_true",
        help="the queue, and its durable messages, survive a restart of the whole site",
    )
    for op, what in (("del-queue", "delete a queue"), ("purge", "purge a queue")):
        p = sub.add_parser(op, help=what)
        p.add_argument("name")
    ex = sub.add_parser("add-exchange", help="declare an exchange")
    ex.add_argument("type", choices=["direct", "fanout", "topic"])
    ex.add_argument("name")
    ex.add_argument("--arg", action="append", default=[], metavar="K=V")
    ex.add_argument(
        "--durable", action="store_true", help="the exchange survives a restart of the whole site"
    )
    dx = sub.add_parser("del-exchange", help="delete an exchange")
    dx.add_argument("name")
    for op in ("bind", "unbind"):
        b = sub.add_parser(op, help=f"{op} a queue to an exchange")
        b.add_argument("name", metavar="EXCHANGE")
        b.add_argument("queue")
        b.add_argument("key", nargs="?", default="")
    sub.add_parser("queues", help="list queues and their depth on each --broker")
    sub.add_parser("exchanges", help="list exchanges and bindings")
    configure_user(sub)


def _args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise AdminError(f"--arg {pair!r}: write it as KEY=VALUE")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def replication_args(replicate: str | None, events: int | None = None) -> dict[str, Any]:
    """The queue arguments for ``--replicate`` and ``--generate-queue-events``.

    A drgate mode gives :func:`protocol.modes.declare_args` of it; a Qpid
    value (``all``, ``configuration``) gives ``qpid.replicate`` alone, as
    qpid-config does; ``--generate-queue-events N`` adds
    ``qpid.queue_event_generation=N``.  Raises :class:`AdminError` when the
    two contradict (``--replicate full --generate-queue-events 1``)."""
    arguments: dict[str, Any] = {}
    if replicate in REPLICATE_ARGS:
        arguments = dict(REPLICATE_ARGS[replicate])
    elif replicate is not None:
        arguments = {REPLICATE_ARG: replicate}
    if events is not None:
        implied = arguments.get(EVENT_GENERATION_ARG)
        if implied is not None and implied != events:
            raise AdminError(
                f"--replicate {replicate} means {EVENT_GENERATION_ARG}={implied}, and "
                f"--generate-queue-events {events} contradicts it: give one of them, or "
                f"Qpid's spelling --replicate all --generate-queue-events {events}"
            )
        arguments[EVENT_GENERATION_ARG] = events
    return arguments


def request_for(args: argparse.Namespace) -> dict[str, Any]:
    request: dict[str, Any] = {"op": args.op, "name": args.name}
    if args.op == "add-queue":
        arguments = _args(args.arg)
        arguments.update(replication_args(args.replicate, args.generate_queue_events))
        if args.max_depth is not None:
            arguments["qpid.max_count"] = args.max_depth
        if args.durable:
            arguments[DURABLE_ARG] = True
        request["args"] = arguments
    elif args.op == "add-exchange":
        request["type"] = args.type
        request["args"] = _args(args.arg)
        if args.durable:
            request["args"][DURABLE_ARG] = True
    elif args.op in ("bind", "unbind"):
        request["queue"] = args.queue
        request["key"] = args.key
    return request


_credentials: dict[str, Any] = {}
"""``user`` and ``password`` for every connection, set by ``run`` from ``--user``."""


def _connect(url: str) -> Any:
    """A blocking AMQP connection to ``url``; :class:`AdminError` if none."""
    from proton.utils import BlockingConnection

    try:
        return BlockingConnection(url, timeout=TIMEOUT_S, **_credentials)
    except Exception as exc:
        raise AdminError(f"cannot connect to {url}: {exc}") from exc


def send_request(url: str, request: dict[str, Any]) -> None:
    """Send one request; returns once every broker of the site applied it.
    Raises :class:`AdminError` with the broker's reason when it refused."""
    from proton import Disposition, Message

    conn = _connect(url)
    try:
        sender = conn.create_sender("$drgate.admin")
        delivery = sender.send(Message(body=json.dumps(request)), error_states=[])
        if delivery.remote_state != Disposition.ACCEPTED:
            condition = delivery.remote.condition
            reason = (
                f"{condition.name}: {condition.description}"
                if condition is not None
                else f"outcome {delivery.remote_state}"
            )
            raise AdminError(f"{url} refused {request['op']} {request.get('name', '')!r}: {reason}")
    finally:
        conn.close()


def describe(url: str) -> dict[str, Any]:
    conn = _connect(url)
    try:
        receiver = conn.create_receiver("$drgate.queues")
        message = receiver.receive(timeout=TIMEOUT_S)
        receiver.accept()
        body = message.body
        if not isinstance(body, str | bytes):
            raise AdminError(f"{url} answered the listing with a non-JSON body")
        result: dict[str, Any] = json.loads(body)
        return result
    finally:
        conn.close()


def login(args: argparse.Namespace, what: str) -> None:
    """Check ``--broker`` and take ``--user``'s password for the connections
    to come; :class:`AdminError` naming ``what`` when no broker is given."""
    if not args.broker:
        raise AdminError(f"{what} needs --broker URL, e.g. --broker amqp://127.0.0.1:5672")
    if args.user:
        password = os.environ.get(PASSWORD_ENV) or getpass.getpass(f"password of {args.user}: ")
        _credentials.update(user=args.user, password=password)


def run(args: argparse.Namespace) -> int:
    if args.op == "user":
        return run_user(args)
    login(args, args.op)
    console = Console()
    if args.op == "queues":
        table = Table(title="queues")
        table.add_column("node")
        table.add_column("queue")
        table.add_column("depth", justify="right")
        table.add_column("acquired", justify="right")
        table.add_column("replica")
        table.add_column("arguments")
        for url in args.broker:
            info = describe(url)
            for q in info["queues"]:
                replica = q["replica"]
                table.add_row(
                    f"{info['node']}",
                    q["name"],
                    str(q["depth"]),
                    str(q["acquired"]),
                    "" if replica is None else f"{replica['mode']} of {replica['origin']}",
                    ", ".join(f"{k}={v}" for k, v in q["args"].items()),
                )
        console.print(table)
        return 0
    if args.op == "exchanges":
        info = describe(args.broker[0])
        table = Table(title=f"exchanges at {info['cluster']}")
        table.add_column("exchange")
        table.add_column("type")
        table.add_column("bindings")
        for x in info["exchanges"]:
            bindings = ", ".join(f"{b['queue']}({b['key']})" for b in x["bindings"])
            table.add_row(x["name"] or "(default)", x["type"], bindings)
        console.print(table)
        return 0
    request = request_for(args)
    send_request(args.broker[0], request)
    console.print(f"{args.op} {args.name}: done")
    return 0
