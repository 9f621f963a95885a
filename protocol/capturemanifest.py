"""The manifest of a collected capture directory: which sidecar wrote each segment, which were cut.

``drgate capture collect`` (gateway/capturecollect.py) gathers the segments of
every sidecar of a site into one directory and writes this manifest at its
root; the analysis jobs read it to report their coverage (analysis/jobs.py).
It is one JSON object, in :data:`MANIFEST_NAME`::

    {"format": "drgate-capture-manifest", "version": 1,
     "collected_at_us": int,              # when the collection ran (µs since the epoch)
     "sources": [str, ...],               # the capture directories read
     "segments": [segment, ...],          # every collected segment, by file
     "rejected": [{"source": str, "file": str, "error": str}, ...]}

    segment := {"file": str,              # path under the manifest's directory, '/'-separated
                "source": str,            # where it was read from
                "site": str, "node": int, "stream": str, "role": str, "incarnation": int,
                "bytes": int,             # file size
                "whole_bytes": int,       # bytes up to the end of its last whole block
                "records": int,           # whole records
                "complete": bool,         # it has its trailer; false: cut (torn or truncated)
                "first_time_us": int, "last_time_us": int}  # 0 when it holds no record

A rejected file failed the segment checks (corruption, not a cut); the
collector keeps it aside (under ``.rejected/``, which readers skip) so that
one bad file does not stop an analysis.  Parsing is strict: a missing or
mistyped field is a :class:`RemoteProtocolError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from protocol.errors import RemoteProtocolError

MANIFEST_NAME: Final = "manifest.json"
FORMAT: Final = "drgate-capture-manifest"
VERSION: Final = 1
REJECTED_DIR: Final = ".rejected"


@dataclass(frozen=True, slots=True)
class ManifestSegment:
    file: str
    source: str
    site: str
    node: int
    stream: str
    role: str
    incarnation: int
    bytes: int
    whole_bytes: int
    records: int
    complete: bool
    first_time_us: int
    last_time_us: int

    @property
    def torn_bytes(self) -> int:
        """Bytes after the last whole block (a record the writer did not finish)."""
        return self.bytes - self.whole_bytes


@dataclass(frozen=True, slots=True)
class Rejected:
    source: str
    file: str
    error: str


@dataclass(frozen=True, slots=True)
class Manifest:
    collected_at_us: int
    sources: tuple[str, ...]
    segments: tuple[ManifestSegment, ...]
    rejected: tuple[Rejected, ...] = ()

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "collected_at_us": self.collected_at_us,
            "sources": list(self.sources),
            "segments": [asdict(s) for s in self.segments],
            "rejected": [asdict(r) for r in self.rejected],
        }
        return json.dumps(doc, indent=1, sort_keys=False) + "\n"


@dataclass(slots=True)
class StreamCoverage:
    """What the manifest holds of one sidecar's stream."""

    site: str
    node: int
    stream: str
    segments: int = 0
    cut: list[str] = field(default_factory=list)  # files of its cut segments
    records: int = 0
    first_time_us: int = 0
    last_time_us: int = 0


def coverage(manifest: Manifest) -> list[StreamCoverage]:
    """One entry per (site, node, stream), sorted: segments, cut ones, records, time span."""
    found: dict[tuple[str, int, str], StreamCoverage] = {}
    for s in manifest.segments:
        key = (s.site, s.node, s.stream)
        entry = found.setdefault(key, StreamCoverage(*key))
        entry.segments += 1
        entry.records += s.records
        if not s.complete:
            entry.cut.append(s.file)
        if s.records:
            if not entry.first_time_us or s.first_time_us < entry.first_time_us:
                entry.first_time_us = s.first_time_us
            entry.last_time_us = max(entry.last_time_us, s.last_time_us)
    return [found[k] for k in sorted(found)]


_SEGMENT_TYPES: Final = {
    "file": str,
    "source": str,
    "site": str,
    "node": int,
    "stream": str,
    "role": str,
    "incarnation": int,
    "bytes": int,
    "whole_bytes": int,
    "records": int,
    "complete": bool,
    "first_time_us": int,
    "last_time_us": int,
}
_REJECTED_TYPES: Final = {"source": str, "file": str, "error": str}


def _fields(item: Any, types: Mapping[str, type], where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise RemoteProtocolError(f"capture manifest: {where} is not an object")
    out = {}
    for name, kind in types.items():
        value = item.get(name)
        # bool is an int to isinstance: an int field must not take true/false
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise RemoteProtocolError(
                f"capture manifest: {where} field {name!r} is {value!r}, not {kind.__name__}"
            )
        out[name] = value
    return out


def parse_manifest_untrusted(text: str | bytes) -> Manifest:
    """The manifest in ``text``; :class:`RemoteProtocolError` when it is not one."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RemoteProtocolError(f"capture manifest is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RemoteProtocolError(f'not a capture manifest (no "format": "{FORMAT}")')
    if doc.get("version") != VERSION:
        raise RemoteProtocolError(
            f"capture manifest version {doc.get('version')!r}; this reader knows {VERSION}"
        )
    at = doc.get("collected_at_us")
    sources = doc.get("sources")
    segments = doc.get("segments")
    rejected = doc.get("rejected", [])
    if not isinstance(at, int) or isinstance(at, bool):
        raise RemoteProtocolError("capture manifest: collected_at_us is not an integer")
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise RemoteProtocolError("capture manifest: sources is not a list of strings")
    if not isinstance(segments, list) or not isinstance(rejected, list):
        raise RemoteProtocolError("capture manifest: segments and rejected must be lists")
    return Manifest(
        collected_at_us=at,
        sources=tuple(sources),
        segments=tuple(
            ManifestSegment(**_fields(s, _SEGMENT_TYPES, f"segments[{i}]"))
            for i, s in enumerate(segments)
        ),
        rejected=tuple(
            Rejected(**_fields(r, _REJECTED_TYPES, f"rejected[{i}]"))
            for i, r in enumerate(rejected)
        ),
    )
