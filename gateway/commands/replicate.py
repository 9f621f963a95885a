"""``drgate replicate QUEUE MODE``: change how a queue of a running site asks
to be replicated.

The counterpart of ``qpid-ha replicate``.  It re-declares the existing queue
with the replication arguments of ``MODE`` (:func:`admin.replication_args`);
the broker merges them over the queue's arguments, and the sidecars' tap
sees the new arguments at once: where the rules leave the queue to
``from-args`` (the shipped examples' default), its mode changes, and D gets
what it lacks for the new mode (the tap's rules-switch path).  A rule that
names the queue with an explicit mode wins over its arguments:
``drgate rules explain RULES --queue QUEUE --arg ...`` says which.
"""

from __future__ import annotations

import argparse

from gateway.commands import admin
from gateway.commands.admin import REPLICATE_CHOICES, REPLICATE_HELP, AdminError
from protocol.modes import Mode, from_args_mode

NAME = "replicate"
HELP = "set a queue's replication arguments on a running site (like qpid-ha replicate)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("queue", metavar="QUEUE", help="an existing queue")
    parser.add_argument("mode", metavar="MODE", choices=REPLICATE_CHOICES, help=REPLICATE_HELP)
    parser.add_argument(
        "--broker",
        action="append",
        required=True,
        metavar="URL",
        help="a broker of the site, e.g. amqp://127.0.0.1:5672",
    )
    parser.add_argument(
        "--user",
        metavar="NAME",
        help=f"authenticate with SASL PLAIN as NAME (password from ${admin.PASSWORD_ENV} "
        "or a prompt)",
    )


def run(args: argparse.Namespace) -> int:
    admin.login(args, "replicate")
    url = args.broker[0]
    queues = {q["name"]: q for q in admin.describe(url)["queues"]}
    if args.queue not in queues:
        raise AdminError(
            f"{url} has no queue {args.queue!r}: declare it with "
            f"'drgate admin --broker {url} add-queue {args.queue} --replicate {args.mode}'"
        )
    arguments = admin.replication_args(args.mode)
    admin.send_request(url, {"op": "add-queue", "name": args.queue, "args": arguments})
    merged = {**queues[args.queue]["args"], **arguments}
    mode, how = from_args_mode(merged, Mode.NONE)
    pairs = ", ".join(f"{k}={v}" for k, v in arguments.items())
    print(f"replicate {args.queue}: {pairs}; from-args reads {how}: mode {mode.label}")
    return 0
