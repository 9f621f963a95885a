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

``drgate replicate pause QUEUE`` and ``resume QUEUE`` set the argument
``x-drgate-replication-paused`` (protocol.modes.PAUSED_ARG) the same way:
while it is true the taps forward nothing of the queue, whatever its mode,
and D keeps the copy it had; on resume D gets what it lacks as on a mode
change (a ``full`` replica is replaced by P's queue; an ``enqueue`` copy
gets P's messages above what it received).  ``/status`` lists paused queues.
"""

from __future__ import annotations

import argparse

from gateway.commands import admin
from gateway.commands.admin import REPLICATE_CHOICES, REPLICATE_HELP, AdminError
from protocol.modes import PAUSED_ARG, Mode, from_args_mode

NAME = "replicate"
HELP = "set a queue's replication arguments on a running site (like qpid-ha replicate)"


ACTIONS = ("pause", "resume")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "queue", metavar="QUEUE|pause|resume", help="an existing queue, or pause or resume"
    )
    parser.add_argument(
        "mode",
        metavar="MODE|QUEUE",
        help=f"{REPLICATE_HELP}; after pause or resume, the queue",
    )
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
    action = args.queue if args.queue in ACTIONS else None
    queue = args.mode if action else args.queue
    if action is None and args.mode not in REPLICATE_CHOICES:
        raise AdminError(
            f"unknown mode {args.mode!r}: use one of {', '.join(REPLICATE_CHOICES)}, or "
            "'drgate replicate pause|resume QUEUE'"
        )
    admin.login(args, "replicate")
    url = args.broker[0]
    queues = {q["name"]: q for q in admin.describe(url)["queues"]}
    if queue not in queues:
        hint = "" if action else f" --replicate {args.mode}"
        raise AdminError(
            f"{url} has no queue {queue!r}: declare it with "
            f"'drgate admin --broker {url} add-queue {queue}{hint}'"
        )
    if action is not None:
        paused = action == "pause"
        admin.send_request(url, {"op": "add-queue", "name": queue, "args": {PAUSED_ARG: paused}})
        print(
            f"replicate {queue}: {PAUSED_ARG}={str(paused).lower()}; "
            + (
                "the sidecars forward nothing of it until 'drgate replicate resume'"
                if paused
                else "D gets what it lacks, as on a mode change"
            )
        )
        return 0
    arguments = admin.replication_args(args.mode)
    admin.send_request(url, {"op": "add-queue", "name": queue, "args": arguments})
    merged = {**queues[args.queue]["args"], **arguments}
    mode, how = from_args_mode(merged, Mode.NONE)
    pairs = ", ".join(f"{k}={v}" for k, v in arguments.items())
    print(f"replicate {queue}: {pairs}; from-args reads {how}: mode {mode.label}")
    return 0
