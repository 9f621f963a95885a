"""``drgate status``: the sidecars (and brokers) of one or both sites in one table.

Fetches ``GET /status`` from every ``--url`` (each sidecar's observability
address) at once, in threads with a timeout, and shows site, node, role, peer,
link state, lag, spool, rules version and last error per row.  An unreachable
sidecar is a row saying why, never a traceback.  ``--watch`` redraws every
second; ``--json`` prints the list of documents (an unreachable one as
``{"url": ..., "error": ...}``) for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from gateway.roles import SidecarRole
from protocol.errors import ConfigError, DrgateError, Location, Problem

NAME = "status"
HELP = "show the sidecars' role, link, lag and spool (from their /status)"
# A sidecar that does not answer within this is shown as unreachable; short,
# because an operator is waiting and --watch redraws every second.
TIMEOUT_S = 2.0
WATCH_INTERVAL_S = 1.0
# /status bodies are a few KB; refuse to read a runaway one.
MAX_BODY_BYTES = 1 << 20


class StatusError(DrgateError):
    """drgate status was given nothing to ask."""


def add_target_arguments(parser: argparse.ArgumentParser, whose: str = "a sidecar's") -> None:
    """``--url`` (repeated) and ``--targets FILE``: the /status addresses to ask."""
    parser.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="URL",
        help=f"{whose} observability address, e.g. http://127.0.0.1:9464 (repeat)",
    )
    parser.add_argument(
        "--targets",
        metavar="FILE",
        help="a file with one URL per line ('#' starts a comment)",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    parser.add_argument("--site", help="show only the rows of this site")
    parser.add_argument("--watch", action="store_true", help="redraw every second")
    parser.add_argument("--json", action="store_true", help="print the documents as JSON")
    parser.add_argument(
        "--timeout", type=float, default=TIMEOUT_S, help=f"seconds per request ({TIMEOUT_S})"
    )


def status_url(url: str) -> str:
    """``url`` as a /status address (``host:port`` and a bare base URL are taken)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.endswith("/status"):
        url += "/status"
    return url


def read_targets(path: str) -> list[str]:
    """The URLs of a targets file; raises ConfigError naming the file when unreadable."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            [Problem(Location(path, 1, 1), f"cannot read the targets file: {exc.strerror}")]
        ) from exc
    urls = []
    for line in text.splitlines():
        url = line.split("#", 1)[0].strip()
        if url:
            urls.append(url)
    return urls


def fetch(url: str, timeout: float) -> dict[str, Any]:
    """One sidecar's /status document, or ``{"url", "error"}`` saying why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read(MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            return {"url": url, "error": "response larger than 1 MiB"}
        document = json.loads(body)
        if not isinstance(document, dict):
            return {"url": url, "error": "response is not a JSON object"}
    except urllib.error.HTTPError as exc:
        return {"url": url, "error": f"HTTP {exc.code} {exc.reason}"}
    except urllib.error.URLError as exc:
        return {"url": url, "error": f"unreachable: {exc.reason}"}
    except (OSError, TimeoutError) as exc:
        return {"url": url, "error": f"unreachable: {exc}"}
    except ValueError as exc:
        return {"url": url, "error": f"not a /status document: {exc}"}
    document["url"] = url
    return document


def collect(urls: Sequence[str], timeout: float, site: str | None = None) -> list[dict[str, Any]]:
    """The documents of every URL, in the order given (unreachable ones included)."""
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(urls)))) as pool:
        documents = list(pool.map(lambda u: fetch(u, timeout), urls))
    if site is not None:
        documents = [d for d in documents if "error" in d or d.get("site") == site]
    return documents


def _fmt(value: Any, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def _bytes(value: Any) -> str:
    if not isinstance(value, int | float):
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "—"  # pragma: no cover


def _resync_text(resync: dict[str, Any], width: int = 10) -> str:
    """A resync in progress as a bar (``resync ███░░ 42%``), or a promoted site.

    ``promoted`` is in /status's ``resync`` object at D (a compatibility field
    that ``gateway.statusdoc.status_document`` fills from the snapshot's
    ``DrSection``)."""
    text = ""
    if resync.get("promoted"):
        text += " [bold magenta]promoted[/]"
    if resync.get("active"):
        ratio = resync.get("progress_ratio")
        ratio = min(1.0, max(0.0, float(ratio))) if isinstance(ratio, int | float) else 0.0
        done = round(ratio * width)
        text += f" [cyan]resync {'█' * done}{'░' * (width - done)} {ratio:.0%}[/]"
    return text


def render(documents: Sequence[dict[str, Any]]) -> Table:
    """One rich table, one row per document."""
    table = Table(title="drgate status", title_justify="left")
    for column in ("site", "node", "role", "peer", "link", "lag ev", "lag s", "ev/s", "spool"):
        table.add_column(column, justify="right" if column.startswith(("lag", "ev")) else "left")
    table.add_column("rules")
    table.add_column("last error", overflow="fold")
    for doc in documents:
        if "error" in doc:
            table.add_row(
                "?", "?", "", doc["url"], "[red]unreachable[/]", "", "", "", "", "",
                f"[red]{doc['error']}[/]",
            )  # fmt: skip
            continue
        role = doc.get("role") or "—"
        if role in (SidecarRole.EGRESS, SidecarRole.INGRESS):
            role = f"[bold green]{role}[/]"
        elif role == SidecarRole.MINORITY:
            role = f"[bold red]{role}[/]"
        link = doc.get("link_state") or "—"
        link_style = {"up": "green", "down": "red", "refused": "yellow"}.get(link, "")
        if link_style:
            link = f"[{link_style}]{link}[/]"
        link += _resync_text(doc.get("resync") or {})
        spool = doc.get("spool") or {}
        spool_text = _bytes(spool.get("bytes"))
        if spool.get("used_ratio") is not None:
            spool_text += f" ({spool['used_ratio']:.0%})"
        if spool.get("needs_resync"):
            spool_text += " [red]resync[/]"
        rates = doc.get("rates") or {}
        rate = rates.get("events_sent_per_second")
        if rate is None:
            rate = rates.get("events_received_per_second")
        table.add_row(
            _fmt(doc.get("site")),
            _fmt(doc.get("node")),
            role,
            _fmt(doc.get("peer")),
            link,
            _fmt(doc.get("lag_events")),
            _fmt(doc.get("lag_seconds"), digits=2),
            _fmt(rate, digits=0),
            spool_text,
            _fmt(doc.get("rules_version")),
            f"[red]{doc['last_error']}[/]" if doc.get("last_error") else "",
        )
    return table


def run(args: argparse.Namespace) -> int:
    urls = list(args.url)
    if args.targets:
        urls += read_targets(args.targets)
    if not urls:
        raise StatusError(
            "no sidecar to ask: give --url http://HOST:PORT (repeatable) or --targets FILE"
        )
    urls = [status_url(u) for u in urls]
    if args.json:
        documents = collect(urls, args.timeout, args.site)
        json.dump(documents, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return 0 if all("error" not in d for d in documents) else 2
    console = Console()
    if not console.is_terminal:
        # Piped or captured: do not cut the table to 80 columns.
        console = Console(width=max(console.width, 200))
    if not args.watch:
        documents = collect(urls, args.timeout, args.site)
        console.print(render(documents))
        return 0 if all("error" not in d for d in documents) else 2
    with Live(render([]), console=console, refresh_per_second=4) as live:
        while True:
            started = time.monotonic()
            live.update(render(collect(urls, args.timeout, args.site)))
            time.sleep(max(0.0, WATCH_INTERVAL_S - (time.monotonic() - started)))
