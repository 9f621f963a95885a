"""``drgate analyze JOB --captures DIR``: run an analysis job over capture segments.

The Spark work lives in :mod:`analysis.jobs`; this module only parses the
command line, checks the capture directory before starting Spark (a session
takes seconds to start), and shows progress.  PySpark is imported only when
the command runs, so the rest of the CLI does not pay for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from protocol.errors import DrgateError

NAME = "analyze"
HELP = "analyse capture segments with Spark: audit, lag or traffic (writes an HTML report)"

JOBS = ("audit", "lag", "traffic")


class AnalyzeError(DrgateError):
    """The analysis cannot start: a missing capture directory, no segments..."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "job",
        choices=JOBS,
        help="audit: exactly-once and order check (exit 1 on a violation); "
        "lag: forward-to-apply lag percentiles; traffic: events, bytes, compression",
    )
    parser.add_argument(
        "--captures",
        required=True,
        metavar="DIR",
        help="directory of capture segments (searched recursively)",
    )
    parser.add_argument(
        "--out",
        default="drgate-analysis",
        metavar="DIR",
        help="output directory",
    )
    parser.add_argument(
        "--master",
        default="local[2]",
        metavar="URL",
        help="Spark master URL (default %(default)s)",
    )
    parser.add_argument(
        "--window-s",
        type=int,
        default=10,
        help="window width in seconds",
    )


def run(args: argparse.Namespace) -> int:
    captures = Path(args.captures)
    if not captures.exists():
        raise AnalyzeError(
            f"capture directory {str(captures)!r} does not exist; pass the directory the "
            "sidecars write capture segments to (capture.directory in the sidecar config)"
        )
    if args.window_s <= 0:
        raise AnalyzeError(f"--window-s must be a positive number of seconds, not {args.window_s}")

    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from analysis import jobs
    from analysis.source import CaptureSourceError

    console = Console(stderr=True)
    try:
        found = jobs.check_captures(captures)
    except CaptureSourceError as exc:
        raise AnalyzeError(str(exc)) from None
    console.print(f"{args.job}: {len(found)} capture segment(s) under {captures}")
    with Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("starting Spark", total=None)

        def step(what: str) -> None:
            progress.update(task, description=what)

        spark = jobs.build_session(args.master)
        try:
            code = jobs.run_job(
                spark, args.job, captures, args.out, window_s=args.window_s, step=step
            )
        except CaptureSourceError as exc:
            raise AnalyzeError(str(exc)) from None
        finally:
            spark.stop()
    report = Path(args.out) / args.job / "report.html"
    if args.job == "audit":
        verdict = "violations found" if code else "clean"
        console.print(f"audit: {verdict}; report: {report}")
    else:
        console.print(f"{args.job}: report: {report}")
    return code
