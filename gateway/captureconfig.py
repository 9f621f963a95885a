"""The sidecar config's ``capture:`` section: :class:`CaptureConfig` and its YAML loader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from filters.yamldoc import Node, Problems, check_keys, expect_bool, expect_int, expect_str
from protocol.capture import Stream

__all__ = ["CaptureConfig", "load_capture"]

# 64 MiB segments: a minute or more of a busy site, small enough for one Spark
# partition each.
DEFAULT_SEGMENT_MAX_BYTES: Final = 64 * 1024 * 1024
# Five minutes: a quiet site's segments still close (and become complete) often.
DEFAULT_SEGMENT_MAX_AGE_S: Final = 300.0
# 4 GiB per sidecar unless told otherwise.
DEFAULT_RETENTION_BYTES: Final = 4 * 1024 * 1024 * 1024
MIN_SEGMENT_BYTES: Final = 4096
STREAM_NAMES: Final = {s.label: s for s in Stream}


@dataclass(frozen=True, slots=True)
class CaptureConfig:
    """The sidecar config's ``capture:`` section."""

    directory: str
    streams: frozenset[Stream] = frozenset(Stream)
    payloads: bool = False
    segment_max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES
    segment_max_age_s: float = DEFAULT_SEGMENT_MAX_AGE_S
    retention_bytes: int = DEFAULT_RETENTION_BYTES


def load_capture(node: Node, problems: Problems) -> CaptureConfig | None:
    """Parse the ``capture:`` section; mistakes go to ``problems`` (file:line:column).

    Example::

        capture:
          directory: /var/lib/drgate/capture
          streams: [tapped, forwarded, ingested]   # default: all three
          payloads: false                          # record the commands' bytes too
          segment_max_bytes: 67108864
          segment_max_age_s: 300
          retention_bytes: 4294967296
    """
    errors_before = len(problems.errors)
    fields = check_keys(
        node,
        problems,
        what="'capture'",
        required=("directory",),
        optional=(
            "streams",
            "payloads",
            "segment_max_bytes",
            "segment_max_age_s",
            "retention_bytes",
        ),
    )
    if fields is None:
        return None
    ok = True
    directory = ""
    if "directory" in fields:
        directory = expect_str(fields["directory"], problems, what="'capture.directory'") or ""
        ok = ok and bool(directory)
    streams = _load_streams(fields["streams"], problems) if "streams" in fields else set(Stream)
    payloads = False
    if "payloads" in fields:
        value = expect_bool(fields["payloads"], problems, what="'capture.payloads'")
        ok = ok and value is not None
        payloads = bool(value)
    sizes = _load_sizes(fields, problems)
    if not ok or streams is None or sizes is None or len(problems.errors) > errors_before:
        return None
    max_bytes, max_age, retention = sizes
    return CaptureConfig(
        directory=directory,
        streams=frozenset(streams),
        payloads=payloads,
        segment_max_bytes=max_bytes,
        segment_max_age_s=max_age,
        retention_bytes=retention,
    )


def _load_streams(snode: Node, problems: Problems) -> set[Stream] | None:
    """``capture.streams``: a non-empty list of stream names; ``None`` after a mistake."""
    if snode.kind != "sequence" or not snode.value:
        problems.error(
            snode.location,
            "'capture.streams' must be a non-empty list",
            f"choose from: {', '.join(STREAM_NAMES)}",
        )
        return None
    streams: set[Stream] = set()
    ok = True
    for item in snode.value:
        name = expect_str(item, problems, what="each item of 'capture.streams'")
        if name is None:
            ok = False
        elif name not in STREAM_NAMES:
            problems.error(
                item.location,
                f"unknown capture stream {name!r}",
                f"use one of: {', '.join(STREAM_NAMES)}",
            )
            ok = False
        else:
            streams.add(STREAM_NAMES[name])
    return streams if ok else None


def _load_sizes(fields: dict[str, Node], problems: Problems) -> tuple[int, float, int] | None:
    """Segment size, segment age and retention; ``None`` after a mistake."""
    ok = True

    def integer(key: str, default: int, minimum: int) -> int:
        nonlocal ok
        if key not in fields:
            return default
        value = expect_int(fields[key], problems, what=f"'capture.{key}'", minimum=minimum)
        if value is None:
            ok = False
            return default
        return value

    max_bytes = integer("segment_max_bytes", DEFAULT_SEGMENT_MAX_BYTES, MIN_SEGMENT_BYTES)
    max_age = float(integer("segment_max_age_s", int(DEFAULT_SEGMENT_MAX_AGE_S), 1))
    retention = integer("retention_bytes", DEFAULT_RETENTION_BYTES, MIN_SEGMENT_BYTES)
    if retention < max_bytes and "retention_bytes" in fields:
        problems.error(
            fields["retention_bytes"].location,
            f"'capture.retention_bytes' ({retention}) is below 'capture.segment_max_bytes' "
            f"({max_bytes})",
            "keep at least a few segments: retention_bytes >= 2 * segment_max_bytes",
        )
        ok = False
    return (max_bytes, max_age, retention) if ok else None
