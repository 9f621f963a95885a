"""``drgate lab up|down|status``: the two-site lab, kept running for you to play with.

``up`` starts site P and site D as ``drgate demo`` does (three brokers and
three sidecars each, one WAN emulator per D sidecar with a 25 ms one-way
delay, the four demo queues declared at P), prints where everything listens,
writes ``WORKDIR/lab.json`` and stays in the foreground until Ctrl-C or
``drgate lab down``; either way every process it started is stopped.
``status`` shows the sidecars' ``/status`` table (as ``drgate status``);
``down`` sends SIGTERM to the running ``lab up`` and waits for it to finish.

``--bus embedded`` (the default) runs on loopback without root.
``--bus corosync`` (root) runs each site on three corosync daemons in network
namespaces (lab/netns.py), each site's bridge joined to the root
namespace, where the WAN emulators run; brokers and sidecars run inside their
node's namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from protocol.errors import DrgateError

NAME = "lab"
HELP = "start, inspect or stop the two-site lab (embedded bus, or corosync as root)"
DEFAULT_WORKDIR = Path("/tmp/drgate-lab")
STATE_FILE = "lab.json"
# How long `lab down` waits for `lab up` to stop its processes (each gets
# SIGTERM then SIGKILL after 10 s, see lab/site.py).
DOWN_TIMEOUT_S = 60.0


class LabCommandError(DrgateError):
    """The lab cannot do what was asked; the message says why and what to do."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--bus", choices=("embedded", "corosync"), default="embedded")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=DEFAULT_WORKDIR,
        help=f"configs, logs, spools and {STATE_FILE} ({DEFAULT_WORKDIR})",
    )


def run(args: argparse.Namespace) -> int:
    state_path: Path = args.workdir / STATE_FILE
    if args.action == "up":
        return _up(args, state_path)
    if args.action == "status":
        return _status(state_path)
    return _down(state_path)


def _read_state(state_path: Path) -> dict[str, Any]:
    try:
        state: dict[str, Any] = json.loads(state_path.read_text())
    except FileNotFoundError:
        raise LabCommandError(
            f"no lab is running from {state_path.parent} ({state_path} is missing); "
            "start one with `drgate lab up`"
        ) from None
    return state


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def corosync_missing() -> str | None:
    """Why `lab up --bus corosync` cannot run here, or None."""
    from lab.netns import lab_unavailable_reason

    return lab_unavailable_reason()


def _up(args: argparse.Namespace, state_path: Path) -> int:
    if args.bus == "corosync":
        reason = corosync_missing()
        if reason:
            raise LabCommandError(f"drgate lab up --bus corosync: {reason}")
    if state_path.exists():
        pid = int(_read_state(state_path)["pid"])
        if _pid_alive(pid):
            raise LabCommandError(
                f"a lab is already running from {args.workdir} (pid {pid}); "
                "`drgate lab down` first, or pass another --workdir"
            )
        state_path.unlink()

    from gateway.demo import QUEUES, WAN_DELAY_MS, sigterm_as_interrupt
    from lab.site import SiteError, TwoSites

    console = Console()
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        with sigterm_as_interrupt():
            console.print("starting site P and site D ...")
            with TwoSites(
                delay_ms=WAN_DELAY_MS, metrics=True, workdir=args.workdir, bus=args.bus
            ) as two:
                for name, mode in QUEUES.items():
                    done = two.p.admin(1, "add-queue", name, "--replicate", mode)
                    if done.returncode != 0:
                        raise LabCommandError(f"declaring {name} failed: {done.stderr.strip()}")
                status_urls = [
                    two.status_url(cluster, node).removesuffix("/status")
                    for cluster, node in sorted(two.metrics_port)
                ]
                state = {
                    "pid": os.getpid(),
                    "bus": args.bus,
                    "amqp": {"site-p": two.p.amqp, "site-d": two.d.amqp},
                    "status": status_urls,
                    "wan_control": two.wan_control,
                    "queues": QUEUES,
                }
                state_path.write_text(json.dumps(state, indent=2) + "\n")
                for site in (two.p, two.d):
                    for node, url in sorted(site.amqp.items()):
                        console.print(f"  {site.cluster} broker {node}: {url}")
                console.print(
                    f"  queues at P: {', '.join(f'{q} ({m})' for q, m in QUEUES.items())}"
                )
                console.print(
                    f"  status:  drgate lab status   (or drgate status --url ...: {status_urls[0]})"
                )
                console.print(f"  queues:  drgate admin --broker {two.p.amqp[1]} queues")
                console.print(
                    f"  publish: python -m lab.client publish {two.p.amqp[1]} q-full --count 100"
                )
                console.print("lab is up; Ctrl-C or `drgate lab down` stops it")
                while True:
                    time.sleep(3600)  # until SIGTERM/Ctrl-C: the lab serves others
    except KeyboardInterrupt:
        console.print("lab stopped: every process it started was stopped")
        return 0
    except SiteError as exc:
        raise LabCommandError(f"the lab failed to start: {exc}") from exc
    finally:
        if state_path.exists() and _read_state(state_path).get("pid") == os.getpid():
            state_path.unlink()


def _status(state_path: Path) -> int:
    from gateway.commands.status import TIMEOUT_S, collect, render, status_url

    state = _read_state(state_path)
    if not _pid_alive(int(state["pid"])):
        raise LabCommandError(f"the lab of {state_path} (pid {state['pid']}) is not running")
    documents = collect([status_url(u) for u in state["status"]], TIMEOUT_S)
    Console().print(render(documents))
    return 0


def _down(state_path: Path) -> int:
    state = _read_state(state_path)
    pid = int(state["pid"])
    if not _pid_alive(pid):
        state_path.unlink()
        print(f"the lab (pid {pid}) was not running; removed {state_path}")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while _pid_alive(pid) and state_path.exists():
        if time.monotonic() > deadline:
            raise LabCommandError(f"the lab (pid {pid}) did not stop in {DOWN_TIMEOUT_S:.0f} s")
        time.sleep(0.2)  # waiting on another process: no event to await
    print(f"lab (pid {pid}) stopped")
    return 0
