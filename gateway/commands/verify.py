"""``drgate verify``: how the DR site's replicas compare with the primary's
queues (docs/operations.md, "Verifying the copies").

The sites compare on their own every ``link.verify_s`` (gateway/verification.py);
this command shows D's last results, read from D sidecars' ``/status``
(``--url``, as ``drgate status`` takes them).  With ``--config`` of a P
sidecar it first asks for a comparison now: it joins P's bus, multicasts a
``VerifyPoint`` and waits until D reports results at or above its cseq.

Exit 0 when every replica compared equal, 1 when one differs, 2 when there
is nothing to show (no D sidecar answered, none has compared yet, or the
comparison asked for did not arrive in time).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import trio

from gateway.commands.status import (
    TIMEOUT_S,
    add_target_arguments,
    collect,
    read_targets,
    status_url,
)
from gateway.config import load_sidecar_config
from gateway.netns import enter_bus_netns
from gateway.resync import open_admin_member
from gateway.roles import runs_as_primary
from protocol import cluster as pc
from protocol.errors import DrgateError

NAME = "verify"
HELP = "show (or ask for) the comparison of D's replicas with P's queues"
WAIT_S = 120.0  # a comparison asked for travels the link behind what P has not sent yet
POLL_S = 1.0


def configure(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser, "a D sidecar's")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a P sidecar's config: compare now (a VerifyPoint on P's bus) and wait for it",
    )
    parser.add_argument(
        "--wait", type=float, default=WAIT_S, help=f"seconds to wait for D's result ({WAIT_S:.0f})"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    given = list(args.url) + (read_targets(args.targets) if args.targets else [])
    urls = [status_url(u) for u in given]
    if not urls:
        raise DrgateError(
            "give --url (a D sidecar's observability address) or --targets FILE: "
            "the results are D's"
        )
    cseq = 0
    if args.config:
        cseq = ask_now(args.config)
        print(f"verification point at cseq {cseq} of P's stream; waiting for D's result")
    deadline = time.monotonic() + (args.wait if cseq else 0)
    while True:
        results = latest(collect(urls, TIMEOUT_S))
        if all_at_or_above(results, cseq) or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)  # polling D's /status: there is nothing to wait on
    return report(results, cseq, urls, as_json=args.json)


def ask_now(config_path: str) -> int:
    """Multicast a ``VerifyPoint`` on the bus of the P sidecar of
    ``config_path``; its cseq."""
    config = load_sidecar_config(config_path)
    if not config.primary and not config.reversible:
        raise DrgateError(
            f"{config_path} is a DR sidecar's config ({config.site}): --config takes a "
            "primary sidecar's, where the verification point is made"
        )
    enter_bus_netns(config.bus)

    async def post() -> int:
        async with open_admin_member(config.site, config.bus) as member:
            state = member.state
            if not runs_as_primary(state, configured=config.primary, reversible=config.reversible):
                raise DrgateError(
                    f"{config.site} is {config.peer_cluster}'s DR site now (a switchover "
                    f"swapped the sites): run drgate verify at {config.peer_cluster}"
                )
            return await member.submit_and_wait(pc.VerifyPoint(int(time.time() * 1e6)))

    return trio.run(post)


def latest(documents: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per queue, the newest result any D sidecar reports (they all apply the
    same stream; a sidecar restarted since has fewer)."""
    best: dict[str, dict[str, Any]] = {}
    for doc in documents:
        for queue, result in ((doc.get("verify") or {}).get("queues") or {}).items():
            if queue not in best or result["origin_cseq"] > best[queue]["origin_cseq"]:
                best[queue] = result
    return best


def all_at_or_above(results: dict[str, dict[str, Any]], cseq: int) -> bool:
    return bool(results) and all(r["origin_cseq"] >= cseq for r in results.values())


def report(
    results: dict[str, dict[str, Any]], cseq: int, urls: Sequence[str], *, as_json: bool
) -> int:
    differ = sorted(q for q, r in results.items() if not r["ok"])
    late = sorted(q for q, r in results.items() if r["origin_cseq"] < cseq)
    code = 2 if not results or late else 1 if differ else 0
    if as_json:
        print(
            json.dumps(
                {"queues": results, "differ": differ, "late": late, "cseq": cseq}, sort_keys=True
            )
        )
        return code
    if not results:
        print(
            f"no result: none of {', '.join(urls)} reports a comparison (a D sidecar, "
            "and P's link.verify_s not 0? The first comes one period after the link is up)"
        )
        return code
    for queue, r in sorted(results.items()):
        verdict = "equal" if r["ok"] else f"DIFFERS: {r['detail']}"
        age = max(0.0, time.time() - r["time_us"] / 1e6)
        where = f"at P cseq {r['origin_cseq']:<10} {age:6.0f} s ago"
        print(f"{queue:<30} {r['mode']:<8} {where}  {verdict}")
    if late:
        behind = ", ".join(late)
        print(f"not yet compared at cseq {cseq}: {behind} (the link is behind: drgate status)")
    if differ:
        print(
            f"{len(differ)} replica(s) differ from P: resync D (drgate resync --config "
            "<a P sidecar's config>) and look for the cause in D's sidecar logs ('verify:')"
        )
    return code
