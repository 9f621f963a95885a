"""``drgate capture collect``: a site's capture segments in one directory, for analysis.

``drgate capture collect --out DIR [--site NAME] SOURCE...``
    Copies the segments under every SOURCE (each sidecar's
    ``capture.directory``, as this machine sees it: a mount or a copy) to
    ``DIR/SITE/node-N/`` and writes ``DIR/manifest.json``: which node and
    stream each segment came from, and which were cut.  Prints the coverage
    per sidecar stream.  Run it again into the same DIR to add what the
    sidecars wrote since.  Then ``drgate analyze audit --captures DIR``
    reports that coverage (docs/analysis.md, "Collecting a site's captures").
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime

from gateway.capturecollect import CollectResult, collect
from protocol.capturemanifest import MANIFEST_NAME, REJECTED_DIR, coverage

NAME = "capture"
HELP = "gather the capture segments of a site's sidecars into one directory with a manifest"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="capture_command", metavar="ACTION", required=True)
    gather = sub.add_parser(
        "collect",
        help="copy every sidecar's segments to one directory and write manifest.json "
        "(node, stream, cut segments)",
    )
    gather.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a sidecar's capture directory (capture.directory), as this machine sees it",
    )
    gather.add_argument("--out", required=True, metavar="DIR", help="the collected directory")
    gather.add_argument("--site", metavar="NAME", help="keep only this site's segments")


def _time(us: int) -> str:
    if not us:
        return "-"
    return datetime.fromtimestamp(us / 1e6, UTC).isoformat(timespec="seconds")


def describe(result: CollectResult, out: str) -> list[str]:
    """The collection for people: one line per sidecar stream, then what was cut or rejected."""
    manifest = result.manifest
    lines = [
        f"{len(manifest.segments)} segment(s) in {out} ({len(result.copied)} copied, "
        f"{len(result.unchanged)} unchanged); manifest: {out}/{MANIFEST_NAME}"
    ]
    for c in coverage(manifest):
        cut = f", {len(c.cut)} cut" if c.cut else ""
        lines.append(
            f"  {c.site} node {c.node} {c.stream}: {c.segments} segment(s){cut}, "
            f"{c.records} records, {_time(c.first_time_us)} .. {_time(c.last_time_us)}"
        )
    cut_files = [s for s in manifest.segments if not s.complete]
    if cut_files:
        lines.append(
            "cut (no trailer: the sidecar died, or the segment was still open when copied; "
            "read up to the last whole record):"
        )
        lines.extend(f"  {s.file}: {s.torn_bytes} torn byte(s)" for s in cut_files)
    if result.other_sites:
        lines.append(f"{result.other_sites} segment(s) of other sites skipped (--site)")
    if result.duplicates:
        lines.append(f"{result.duplicates} segment(s) already collected from another source")
    return lines


def run(args: argparse.Namespace) -> int:
    result = collect(args.sources, args.out, site=args.site, now_us=time.time_ns() // 1000)
    print("\n".join(describe(result, args.out)))
    for r in result.manifest.rejected:
        print(
            f"drgate capture: rejected {r.source} (kept aside as {args.out}/{r.file}, "
            f"not analysed): {r.error}",
            file=sys.stderr,
        )
    if result.manifest.rejected:
        print(
            f"drgate capture: {len(result.manifest.rejected)} file(s) under "
            f"{args.out}/{REJECTED_DIR} failed the segment checks",
            file=sys.stderr,
        )
    return 0
