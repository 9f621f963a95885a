"""Gather the capture segments of a site's sidecars into one directory, with a manifest.

Each sidecar writes its segments to its own ``capture.directory``; an audit
wants them all in one place, and wants to know what it is looking at: which
node and stream each segment came from, and which were cut (the writer died,
or the segment was still open when it was copied).  :func:`collect` reads
every segment under the given source directories, checks it with
:func:`protocol.capture.scan_segment_untrusted`, copies it to
``OUT/SITE/node-N/NAME`` and writes ``OUT/manifest.json``
(protocol/capturemanifest.py).  Run again, it updates the same directory:
segments that grew since (a sidecar's open segment) are copied again, the
manifest keeps what earlier runs collected.

A file that fails the checks (corruption, not a cut) is kept aside under
``OUT/.rejected/`` and listed as rejected; readers skip hidden folders, so one
bad file does not stop an analysis.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from protocol.capture import MAGIC, SegmentScan, scan_segment_untrusted
from protocol.capturemanifest import (
    MANIFEST_NAME,
    REJECTED_DIR,
    Manifest,
    ManifestSegment,
    Rejected,
    parse_manifest_untrusted,
)
from protocol.errors import DrgateError, RemoteProtocolError

_WALL_TIME = struct.Struct(">Q")  # the record head's first field


class CollectError(DrgateError):
    """The collection cannot be done: a missing source, an output that is not ours..."""


@dataclass
class CollectResult:
    manifest: Manifest
    copied: list[str] = field(default_factory=list)  # files written (new or grown)
    unchanged: list[str] = field(default_factory=list)
    other_sites: int = 0  # segments skipped by the site filter
    duplicates: int = 0  # segments the output already held (a source given twice)


def _starts_like_segment(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            start = fh.read(len(MAGIC))
    except OSError:
        return False
    return MAGIC.startswith(start) if len(start) < len(MAGIC) else start == MAGIC


def _candidates(source: Path, skip: Path) -> Iterator[Path]:
    if source.is_file():
        yield source
        return
    for dirpath, dirnames, filenames in os.walk(source):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and (here / d).resolve() != skip
        )
        for name in sorted(filenames):
            if not name.startswith(".") and _starts_like_segment(here / name):
                yield here / name


def _entry(rel: str, source: Path, data: bytes, scan: SegmentScan) -> ManifestSegment:
    header = scan.header
    assert header is not None
    offsets = scan.record_offsets
    first = _WALL_TIME.unpack_from(data, offsets[0])[0] if offsets else 0
    last = _WALL_TIME.unpack_from(data, offsets[-1])[0] if offsets else 0
    return ManifestSegment(
        file=rel,
        source=str(source),
        site=header.site,
        node=header.node,
        stream=header.stream.label,
        role=header.role.label,
        incarnation=header.incarnation,
        bytes=len(data),
        whole_bytes=len(data) if scan.cut_at is None else scan.cut_at,
        records=scan.records,
        complete=scan.complete,
        first_time_us=first,
        last_time_us=last,
    )


def _write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)


def load_manifest(out: Path) -> Manifest | None:
    """The manifest of an earlier collection into ``out``, if any."""
    path = out / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        return parse_manifest_untrusted(path.read_bytes())
    except RemoteProtocolError as exc:
        raise CollectError(
            f"{path} is not a capture manifest ({exc}); collect into an empty directory "
            "or one an earlier 'drgate capture collect' wrote"
        ) from None


def collect(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    now_us: int,
    site: str | None = None,
) -> CollectResult:
    """Copy the segments under ``sources`` to ``out`` and write its manifest.

    ``site``: keep only that site's segments.  Raises :class:`CollectError`
    for a missing source, an output inside a source, or no segment found.
    """
    target = Path(out)
    resolved = target.resolve()
    roots = [Path(s) for s in sources]
    for root in roots:
        if not root.exists():
            raise CollectError(
                f"capture source {str(root)!r} does not exist; pass each sidecar's "
                "capture.directory as this machine sees it (a mount or a copy)"
            )
        if resolved == root.resolve() or root.resolve() in resolved.parents:
            raise CollectError(
                f"the output {str(target)!r} is inside the source {str(root)!r}; "
                "collect into a directory of its own"
            )
    previous = load_manifest(target)
    entries = {s.file: s for s in previous.segments} if previous else {}
    rejected = {r.source: r for r in previous.rejected} if previous else {}
    result = CollectResult(manifest=Manifest(0, (), ()))
    for root in roots:
        for path in _candidates(root, resolved):
            data = path.read_bytes()
            try:
                scan = scan_segment_untrusted(data)
                if scan.header is None:
                    raise RemoteProtocolError("cut before its header was whole: nothing to read")
            except RemoteProtocolError as exc:
                known = rejected.get(str(path))
                aside = known.file if known else f"{REJECTED_DIR}/{len(rejected)}-{path.name}"
                _write(target / aside, data)
                rejected[str(path)] = Rejected(str(path), aside, str(exc))
                continue
            header = scan.header
            if site is not None and header.site != site:
                result.other_sites += 1
                continue
            spot = _place(f"{header.site}/node-{header.node}", path, data, target, entries)
            if spot is None:  # the same segment from another source, no newer
                result.duplicates += 1
                continue
            rel = spot
            dest = target / rel
            if dest.exists() and dest.stat().st_size == len(data) and dest.read_bytes() == data:
                result.unchanged.append(rel)
            else:
                _write(dest, data)
                result.copied.append(rel)
            entries[rel] = _entry(rel, path, data, scan)
    if not entries:
        raise CollectError(
            "no capture segments under "
            + ", ".join(repr(str(r)) for r in roots)
            + (f" for site {site!r}" if site else "")
            + "; is capture enabled in the sidecars' config (capture.directory)?"
        )
    manifest = Manifest(
        collected_at_us=now_us,
        sources=tuple(dict.fromkeys([*(previous.sources if previous else ()), *map(str, roots)])),
        segments=tuple(entries[k] for k in sorted(entries)),
        rejected=tuple(rejected.values()),
    )
    _write(target / MANIFEST_NAME, manifest.to_json().encode("utf-8"))
    result.manifest = manifest
    return result


def _place(
    folder: str, path: Path, data: bytes, target: Path, entries: dict[str, ManifestSegment]
) -> str | None:
    """Where ``path`` goes under the output; ``None`` when the output already holds it.

    A segment keeps its name (the sidecars' names are unique per site and
    node).  When the name is taken by another source's file, the two are the
    same segment copied at two moments if one is a prefix of the other: the
    longer one is kept.  Otherwise this one gets a ``~N`` suffix.
    """
    n = 1
    while True:
        name = path.name if n == 1 else f"{path.stem}~{n}{path.suffix}"
        rel = f"{folder}/{name}"
        dest = target / rel
        known = entries.get(rel)
        if (known is None and not dest.exists()) or (known and known.source == str(path)):
            return rel
        old = dest.read_bytes() if dest.exists() else b""
        if old.startswith(data):
            return None
        if data.startswith(old):
            return rel
        n += 1
