"""Tables, plots and the self-contained HTML report of an analysis job.

Layout of a job's output directory::

    OUT/JOB/tables/NAME.parquet   every table, complete
    OUT/JOB/tables/NAME.csv
    OUT/JOB/plots/NAME.png
    OUT/JOB/report.html           one file: plots embedded as base64 PNG, tables as HTML

The report shows at most :data:`MAX_HTML_ROWS` rows of a table and says so;
the Parquet and CSV files are complete.  Tables are small aggregates (or the
violation list), so they are written from the driver with pandas.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.axes import Axes

from protocol.capturemanifest import MANIFEST_NAME, Manifest

MAX_HTML_ROWS = 500
TOP_QUEUES = 10  # queues drawn in per-queue plots: the busiest ones

TITLES = {
    "audit": "Exactly-once audit: P forwarded against D ingested",
    "lag": "Replication lag: P forward time to D apply time",
    "traffic": "Traffic: events and bytes per queue, mode and rule",
}

Plot = tuple[str, str, Callable[[Axes], None]]


def _png(title: str, draw: Callable[[Axes], None]) -> bytes:
    fig, ax = plt.subplots(figsize=(9, 4))
    try:
        draw(ax)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png", dpi=80)
        return out.getvalue()
    finally:
        plt.close(fig)


def _lines(frame: pd.DataFrame, x: str, ys: list[str], ylabel: str) -> Callable[[Axes], None]:
    def draw(ax: Axes) -> None:
        for y in ys:
            if len(frame):
                ax.plot(frame[x], frame[y], marker=".", label=y)
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelrotation=30)

    return draw


def _series(
    frame: pd.DataFrame, x: str, group: str, y: str, ylabel: str, top: int = TOP_QUEUES
) -> Callable[[Axes], None]:
    def draw(ax: Axes) -> None:
        if len(frame):
            keys = frame.groupby(group, dropna=False)[y].sum().nlargest(top).index
            for key in keys:
                part = frame[frame[group].isna()] if pd.isna(key) else frame[frame[group] == key]
                ax.plot(part[x], part[y], marker=".", label=str(key))
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelrotation=30)

    return draw


def _bars(labels: list[str], values: list[float], ylabel: str) -> Callable[[Axes], None]:
    def draw(ax: Axes) -> None:
        ax.bar(labels, values, color="tab:blue")
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelrotation=30)

    return draw


def plots_for(job: str, frames: dict[str, pd.DataFrame]) -> list[Plot]:
    """The plots of a job: (name, title, drawing function)."""
    if job == "audit":
        from analysis.jobs import VIOLATION_KINDS

        counts = frames["violations"]["violation"].value_counts()
        per_queue = frames["per_queue"].fillna({"queue": "(none)"})

        def forwarded_vs_applied(ax: Axes) -> None:
            x = range(len(per_queue))
            ax.bar([i - 0.2 for i in x], per_queue["forwarded"], 0.4, label="forwarded at P")
            ax.bar([i + 0.2 for i in x], per_queue["applied"], 0.4, label="applied at D")
            ax.set_xticks(list(x), per_queue["queue"].astype(str).tolist(), rotation=30)
            ax.set_ylabel("events")

        return [
            (
                "violations",
                "Violations by type",
                _bars(
                    list(VIOLATION_KINDS),
                    [int(counts.get(k, 0)) for k in VIOLATION_KINDS],
                    "violations",
                ),
            ),
            ("per_queue", "Events forwarded at P and applied at D", forwarded_vs_applied),
        ]
    if job == "lag":
        return [
            (
                "lag_overall",
                "Lag percentiles over time (all queues)",
                _lines(frames["overall"], "window_start", ["p50_ms", "p90_ms", "p99_ms"], "ms"),
            ),
            (
                "lag_per_queue",
                "p99 lag per queue (busiest queues)",
                _series(frames["per_queue"], "window_start", "queue", "p99_ms", "ms"),
            ),
        ]
    if job == "traffic":
        by_queue = frames["by_queue"]
        by_mode = frames["by_mode"]
        by_rule = frames["by_rule"]
        return [
            (
                "events_per_queue",
                "Events per queue over time (all streams)",
                _series(by_queue, "window_start", "queue", "events", "events per window"),
            ),
            (
                "bytes_per_mode",
                "Bytes per mode over time (all streams)",
                _series(by_mode, "window_start", "mode", "bytes", "bytes per window"),
            ),
            (
                "events_per_rule",
                "Events per rule over time (all streams)",
                _series(by_rule, "window_start", "rule", "events", "events per window"),
            ),
            (
                "compression",
                "Link compression ratio (raw / wire bytes)",
                _lines(frames["compression"], "window_start", ["ratio"], "ratio"),
            ),
        ]
    raise ValueError(f"unknown job {job!r}")


def _table_html(name: str, frame: pd.DataFrame) -> str:
    shown = frame.head(MAX_HTML_ROWS)
    note = ""
    if len(frame) > MAX_HTML_ROWS:
        note = (
            f'<p class="note">First {MAX_HTML_ROWS} of {len(frame)} rows; '
            f"the whole table is in tables/{html.escape(name)}.csv.</p>"
        )
    body = shown.to_html(index=False, na_rep="", table_id=f"table-{name}", border=0, escape=True)
    return f'<h3 id="{html.escape(name)}">{html.escape(name)} ({len(frame)} rows)</h3>{note}{body}'


STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: right; }
th { background: #eee; }
.verdict-ok { color: #060; } .verdict-bad { color: #a00; }
img { max-width: 100%; border: 1px solid #ddd; margin-bottom: 1em; }
.note { color: #666; }
"""


def _coverage_html(manifest: Manifest, table: pd.DataFrame | None) -> str:
    at = pd.to_datetime(manifest.collected_at_us, unit="us", utc=True)
    cut = [s.file for s in manifest.segments if not s.complete]
    parts = [
        f'<p id="coverage-note">Coverage from {MANIFEST_NAME} (collected {html.escape(str(at))} '
        f"from {len(manifest.sources)} source(s)): {len(manifest.segments)} segment(s) of "
        f"{0 if table is None else len(table)} sidecar stream(s), {len(cut)} cut.</p>"
    ]
    missing = 0 if table is None else int(table["missing_segments"].sum())
    if missing:
        parts.append(
            f'<p class="verdict-bad">{missing} segment(s) of the manifest were not read '
            "(deleted since the collection): see the coverage table.</p>"
        )
    if manifest.rejected:
        names = ", ".join(html.escape(f"{r.source} ({r.error})") for r in manifest.rejected)
        parts.append(
            f'<p class="verdict-bad">Rejected at collection (corrupt, not analysed): {names}</p>'
        )
    return "".join(parts)


def render_html(
    job: str,
    frames: dict[str, pd.DataFrame],
    images: dict[str, tuple[str, bytes]],
    verdict: str,
    manifest: Manifest | None = None,
) -> str:
    """One self-contained page: verdict, plots (base64 PNG), then every table."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>drgate {html.escape(job)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(TITLES.get(job, job))}</h1>",
        verdict,
    ]
    if manifest is not None:
        parts.append(_coverage_html(manifest, frames.get("coverage")))
    cut = frames.get("segments")
    if cut is not None and len(cut) and not cut["complete"].all():
        names = ", ".join(html.escape(str(s)) for s in cut.loc[~cut["complete"], "segment"])
        parts.append(
            f'<p class="verdict-bad">Cut segments (no trailer; read up to their last whole '
            f"record): {names}</p>"
        )
    parts.append("<h2>Plots</h2>")
    for name, (title, png) in images.items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure id="plot-{html.escape(name)}"><img alt="{html.escape(name)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{html.escape(title)}'
            "</figcaption></figure>"
        )
    parts.append("<h2>Tables</h2>")
    parts.extend(_table_html(name, frame) for name, frame in frames.items())
    parts.append("</body></html>")
    return "\n".join(parts)


def _verdict(job: str, frames: dict[str, pd.DataFrame]) -> str:
    if job != "audit":
        return ""
    n = len(frames["violations"])
    uncovered = len(frames.get("not_captured", ()))
    beyond = (
        f" {uncovered} forwarded event(s) came after the last application D's captures show: "
        "not captured, so not judged (see the not_captured table; D's /status says what it "
        "applied)."
        if uncovered
        else ""
    )
    if n == 0:
        return (
            '<p class="verdict-ok" id="verdict">No violation: every forwarded event D\'s '
            f"captures cover was applied once, in order.{html.escape(beyond)}</p>"
        )
    return f'<p class="verdict-bad" id="verdict">{n} violation(s) found.{html.escape(beyond)}</p>'


def write_job_outputs(
    job: str,
    frames: dict[str, pd.DataFrame],
    target: Path,
    *,
    window_s: int = 0,
    manifest: Manifest | None = None,
) -> Path:
    """Write tables (Parquet, CSV), plots (PNG) and report.html under ``target``.

    ``manifest``: the collected directory's, when there is one (its coverage is
    said at the top of the page).
    """
    tables = target / "tables"
    plots = target / "plots"
    tables.mkdir(parents=True, exist_ok=True)
    plots.mkdir(parents=True, exist_ok=True)
    for name, frame in frames.items():
        frame.to_parquet(tables / f"{name}.parquet", index=False)
        frame.to_csv(tables / f"{name}.csv", index=False)
    images: dict[str, tuple[str, bytes]] = {}
    for name, plot_title, draw in plots_for(job, frames):
        title = plot_title
        if window_s and "over time" in title:
            title = f"{title}, {window_s} s windows"
        png = _png(title, draw)
        (plots / f"{name}.png").write_bytes(png)
        images[name] = (title, png)
    page = target / "report.html"
    page.write_text(
        render_html(job, frames, images, _verdict(job, frames), manifest), encoding="utf-8"
    )
    return page
