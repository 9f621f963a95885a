"""Structured logs: one line per event, ``key=value`` or JSON, with site, node and role.

:func:`configure_logging` installs one handler on the root logger, so every
module's ``logging.getLogger(__name__)`` writes through it.  Each line carries
``ts`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``, ``site``,
``node``, ``role`` (read through a callable at each line, since the role
changes on a view change), ``msg``, then ``cseq`` and any other field passed
with ``extra={...}`` (for example ``log.info("resync started", extra={"cseq":
n, "peer": addr})``), then ``exc`` when an exception is logged.  A line never
contains a newline: tracebacks are escaped.

Nothing on the hot path logs per message: log events (a view change, a
reconnect, a rules switch, an overflow), not messages.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

FORMATS = ("kv", "json")

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = frozenset(vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None))) | {
    "message",
    "asctime",
    "taskName",
}
# Filled by the context filter; never repeated as extras.
_CONTEXT = ("site", "node", "role")


def _timestamp(created: float) -> str:
    moment = _dt.datetime.fromtimestamp(created, tz=_dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, Any]:
    """The ordered fields of one line."""
    fields: dict[str, Any] = {
        "ts": _timestamp(record.created),
        "level": record.levelname.lower(),
        "logger": record.name,
    }
    for key in _CONTEXT:
        fields[key] = getattr(record, key, None)
    fields["msg"] = record.getMessage()
    cseq = getattr(record, "cseq", None)
    if cseq is not None:
        fields["cseq"] = cseq
    for key, value in vars(record).items():
        if key in _STANDARD or key in _CONTEXT or key == "cseq" or key.startswith("_"):
            continue
        fields[key] = value
    if record.exc_info:
        fields["exc"] = formatter.formatException(record.exc_info)
    elif record.exc_text:
        fields["exc"] = record.exc_text
    return fields


def _kv_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    text = str(value)
    if text and not any(c in text for c in ' "=\\') and text.isprintable():
        return text
    # JSON string quoting escapes quotes, backslashes and newlines.
    return json.dumps(text, ensure_ascii=False)


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=... site=site-p node=1 role=egress msg="..." cseq=42``."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_kv_value(v)}" for k, v in _fields(record, self).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line with the same fields as :class:`KeyValueFormatter`."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record, self), default=str, ensure_ascii=False)


class ContextFilter(logging.Filter):
    """Adds site, node and the current role to every record it passes."""

    def __init__(self, site: str | None, node: int | None, role_getter: Callable[[], str]) -> None:
        super().__init__()
        self.site = site
        self.node = node
        self.role_getter = role_getter

    def filter(self, record: logging.LogRecord) -> bool:
        record.site = self.site
        record.node = self.node
        try:
            record.role = self.role_getter()
        except Exception:
            # A log line must never fail because of the role; say so in the line.
            record.role = "?"
        return True


class _DrgateHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler this module installed, so a second call replaces it."""


def configure_logging(
    format: str = "kv",
    level: int | str = logging.INFO,
    *,
    site: str | None = None,
    node: int | None = None,
    role_getter: Callable[[], str] = lambda: "starting",
    stream: TextIO | None = None,
) -> logging.Handler:
    """Install the structured handler on the root logger and return it.

    Calling it again replaces the handler it installed before (other handlers
    are left alone).  Raises ``ValueError`` for an unknown format or level (config
    loaders check both first, with the file's location).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown log format {format!r}; use one of: {', '.join(FORMATS)}")
    if isinstance(level, str):
        resolved = logging.getLevelName(level.upper())
        if not isinstance(resolved, int):
            raise ValueError(
                f"unknown log level {level!r}; use one of: debug, info, warning, error, critical"
            )
        level = resolved
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _DrgateHandler)]:
        root.removeHandler(old)
        old.close()
    handler = _DrgateHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if format == "json" else KeyValueFormatter())
    handler.addFilter(ContextFilter(site, node, role_getter))
    root.addHandler(handler)
    root.setLevel(level)
    return handler
