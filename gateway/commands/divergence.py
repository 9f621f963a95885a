"""``drgate divergence --config sidecar.yaml --after CSEQ --out DIR``: what an
old primary accepted that its DR site never applied, after a forced
failover (docs/operations.md, "What a failover discarded").

Run at the old primary with one of its sidecars' configs; ``--after`` is
the last of its cseqs the DR site applied (``drgate promote`` printed it;
the split brain's refusal names it too).  It reads that sidecar's spool
(without stopping it or changing it), prints per queue what the tail did,
and records the tail under ``--out`` as a capture that ``drgate analyze``
reads.  A tail the spool does not hold whole is said so, with the missing
cseqs: another sidecar of the site may hold them (run it there too).
Exit 0 with the whole tail, 1 when part of it is missing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gateway.config import load_sidecar_config
from gateway.divergence import QueueTail, tail_of
from gateway.spoolfile import Event
from protocol.errors import DrgateError

NAME = "divergence"
HELP = "after a forced failover: what the old primary accepted that the DR site never applied"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, metavar="FILE", help="a sidecar config of the old primary"
    )
    parser.add_argument(
        "--after",
        required=True,
        type=int,
        metavar="CSEQ",
        help="the DR site's last applied cseq of this site (drgate promote printed it)",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="where to record the tail as a capture"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    config = load_sidecar_config(args.config)
    if args.after < 0:
        raise DrgateError(f"--after must be a cseq (0 or more), not {args.after}")
    tail = tail_of(config.spool_dir, args.after)
    events, missing, queues = tail.events, tail.missing, tail.queues
    written = tail.record(Path(args.out), site=config.site, node=config.node)
    result = {
        "site": config.site,
        "after": args.after,
        "events": len(events),
        "last_cseq": events[-1][0] if events else None,
        "missing": [list(r) for r in missing],
        "capture": [str(p) for p in written],
        "queues": {
            name: {
                "events": q.events,
                "published": len(q.published),
                "message_ids": q.published,
                "dequeued": q.dequeued,
                "other": q.other,
            }
            for name, q in queues.items()
        },
    }
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(_text(config.site, args.after, events, queues, missing, written))
    return 1 if missing else 0


def _text(
    site: str,
    after: int,
    events: list[Event],
    queues: dict[str, QueueTail],
    missing: list[tuple[int, int]],
    written: list[Path],
) -> str:
    last = events[-1][0] if events else after
    lines = [
        f"{site} after cseq {after}: {len(events)} events the DR site never applied "
        f"(up to cseq {last})"
    ]
    for name, q in queues.items():
        span = f" ({q.published[0]} .. {q.published[-1]})" if q.published else ""
        other = "".join(f", {n} {kind}" for kind, n in sorted(q.other.items()))
        lines.append(f"  {name}: {len(q.published)} published{span}, {q.dequeued} dequeued{other}")
    for first, last_missing in missing:
        lines.append(
            f"  missing: cseqs {first}..{last_missing} are not in this spool (an overflow, or "
            "this sidecar was down); run this at the site's other sidecars too"
        )
    if written:
        paths = ", ".join(str(p) for p in written)
        lines.append(f"recorded as a capture: {paths} (drgate analyze JOB --captures DIR)")
    return "\n".join(lines)
