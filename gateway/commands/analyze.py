"""``drgate analyze JOB --captures DIR``: run an analysis job over capture segments.

The Spark work lives in :mod:`analysis.jobs`.  This command is a launcher: it
checks the capture directory before anything starts (a Spark session takes
seconds), runs ``python -m analysis.jobs`` as a child process -- the same
entry point ``spark-submit`` uses -- and shows the job's progress lines with
rich.  So the sidecar package never imports PySpark, and ``gateway/`` keeps
to its arrows (it does not import ``analysis/``).
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from protocol.capture import MAGIC
from protocol.errors import DrgateError

NAME = "analyze"
HELP = "analyse capture segments with Spark: audit, lag or traffic (writes an HTML report)"

JOBS = ("audit", "lag", "traffic")
PROGRESS_PREFIX = "drgate-progress: "  # analysis.jobs.PROGRESS_PREFIX
ERROR_TAIL_LINES = 30  # lines of the job's stderr shown when it fails
# A Spark master that does not accept a TCP connection in this time is not
# there: Spark itself would retry for a minute before giving up.
MASTER_CONNECT_TIMEOUT_S = 5.0


class AnalyzeError(DrgateError):
    """The analysis cannot start or failed: a missing capture directory, no segments..."""


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
        help="directory of capture segments (searched recursively): a path every executor "
        "can read, or a URI (file://, s3://, gs://, hdfs://, abfs://; docs/analysis.md)",
    )
    parser.add_argument("--out", default="drgate-analysis", metavar="DIR", help="output directory")
    parser.add_argument(
        "--master", default="local[2]", metavar="URL", help="Spark master URL (default local[2])"
    )
    parser.add_argument("--window-s", type=int, default=10, help="window width in seconds")
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting for the job (repeatable), e.g. spark.executor.memory=2g",
    )


def count_segments(captures: Path) -> int:
    """Files under ``captures`` that start like a capture segment."""
    found = 0
    for dirpath, dirnames, filenames in os.walk(captures):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as fh:
                    start = fh.read(len(MAGIC))
            except OSError:
                continue
            if MAGIC.startswith(start) if len(start) < len(MAGIC) else start == MAGIC:
                found += 1
    return found


def local_path(captures: str) -> Path | None:
    """The local path of ``captures`` (a plain path or a file:// URI); None for other URIs."""
    if "://" not in captures:
        return Path(captures)
    parts = urlsplit(captures)
    if parts.scheme.lower() != "file":
        return None
    return Path(unquote(parts.path))


def check_master(master: str) -> None:
    """Raise AnalyzeError unless a ``spark://`` master accepts a connection (others pass)."""
    if not master.startswith("spark://"):
        return
    problems = []
    for address in master.removeprefix("spark://").split(","):  # several: HA masters
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise AnalyzeError(
                f"--master {master!r}: a standalone master is spark://HOST:PORT (port 7077 "
                "unless the master was started with another)"
            )
        try:
            with socket.create_connection((host, int(port)), MASTER_CONNECT_TIMEOUT_S):
                return
        except OSError as exc:
            problems.append(f"{address}: {exc.strerror or exc}")
    raise AnalyzeError(
        f"cannot reach the Spark master {master} ({'; '.join(problems)}); start it, or check "
        "the URL its log prints ('Starting Spark master at spark://...'), or run on this "
        "machine with --master local[2]"
    )


def _check(args: argparse.Namespace) -> int:
    """The number of capture segments to analyse (-1: not known here, a remote URI);
    raises AnalyzeError for bad input."""
    if args.window_s <= 0:
        raise AnalyzeError(f"--window-s must be a positive number of seconds, not {args.window_s}")
    for conf in args.conf:
        if "=" not in conf or not conf.split("=", 1)[0]:
            raise AnalyzeError(f"--conf {conf!r}: write KEY=VALUE (spark.executor.memory=2g)")
    check_master(args.master)
    captures = local_path(args.captures)
    if captures is None:  # s3://, hdfs://...: the job lists them, with its file systems
        return -1
    if not captures.exists():
        raise AnalyzeError(
            f"capture directory {str(captures)!r} does not exist; pass the directory the "
            "sidecars write capture segments to (capture.directory in the sidecar config), "
            "or the one 'drgate capture collect' gathered them in"
        )
    segments = count_segments(captures)
    if not segments:
        raise AnalyzeError(
            f"no capture segments under {str(captures)!r}; is capture enabled in the "
            "sidecar config (capture.directory) and is this that directory?"
        )
    return segments


def run(args: argparse.Namespace) -> int:
    segments = _check(args)
    from rich.console import Console

    console = Console(stderr=True)
    found = f"{segments} capture segment(s)" if segments >= 0 else "capture segments"
    console.print(f"{args.job}: {found} under {args.captures}, Spark master {args.master}")
    command = [
        sys.executable,
        "-m",
        "analysis.jobs",
        args.job,
        "--captures",
        str(args.captures),
        "--out",
        str(args.out),
        "--master",
        args.master,
        "--window-s",
        str(args.window_s),
    ]
    for conf in args.conf:
        command += ["--conf", conf]
    code, tail = _run_job(command, console)
    report = Path(args.out) / args.job / "report.html"
    # analysis.jobs exits 0 (done), 1 (audit found violations), 2 (bad input), 3 (crash)
    if code == 2:  # the job's one-line reason, without the JVM's start-up noise
        said = [line.removeprefix("analysis: ") for line in tail if line.startswith("analysis: ")]
        raise AnalyzeError("\n".join(said or tail))
    if code not in (0, 1) or not report.exists():
        raise AnalyzeError(
            f"the {args.job} job failed (exit {code}); its last output:\n" + "\n".join(tail)
        )
    if args.job == "audit":
        console.print(f"audit: {'violations found' if code else 'clean'}; report: {report}")
    else:
        console.print(f"{args.job}: report: {report}")
    return code


def _run_job(command: list[str], console: Any) -> tuple[int, list[str]]:
    """Run the job, showing its progress lines; its exit code and last lines."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
    with Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("starting Spark", total=None)
        with subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable)},
        ) as child:
            assert child.stdout is not None
            for raw in child.stdout:
                line = raw.rstrip("\n")
                if line.startswith(PROGRESS_PREFIX):
                    progress.update(task, description=line[len(PROGRESS_PREFIX) :])
                elif line:
                    tail.append(line)
            code = child.wait()
    return code, list(tail)
