"""The ``drgate-capture`` Spark data source: capture segments as a DataFrame.

Usage::

    from analysis.source import CaptureDataSource
    spark.dataSource.register(CaptureDataSource)
    df = spark.read.format("drgate-capture").load("/var/lib/drgate/capture")

``load(location)`` takes a segment file or a directory searched recursively, as
a plain path (made absolute) or a URI (:data:`SCHEMES`: ``file://``, and
through pyarrow's file systems ``s3://`` (also ``s3a://``, ``s3n://``),
``gs://``, ``hdfs://``, ``abfs://``).  A file is a segment when it starts with
the capture magic (other files, and hidden files and folders, are skipped);
the ``glob`` option (default ``*``) narrows the file names considered.  Option
``payloads`` (``true``/``false``, default false) fills the ``payload`` column.

One Spark partition per segment.  The driver plans them from the listing
(file sizes) and each file's first 6 bytes; it reads no segment.  Each
executor opens its segment itself, through the location's file system: a
plain path must be the same shared path on every executor.

Rows: one row per (record, queue) -- a record naming several queues gives
several rows (``queue_index`` 0, 1, ...; ``queue_count`` says how many), a
record naming none gives one row with a null ``queue``.  Per-queue auditing
needs one row per queue; counting events counts rows with ``queue_index = 0``.
``bytes`` and ``wire_bytes`` repeat on every row of a record.

The reader decodes a whole segment with
:func:`protocol.capture.scan_segment_untrusted` (every block checked), then
reads the fixed-size fields of all records at once with numpy and yields
Arrow record batches, so no Python object is made per record.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from analysis.scan import scan_segment_heads, u32_at
from protocol.capture import (
    MAGIC,
    NO_RULE,
    RECORD_HEAD_FIELDS,
    RECORD_HEAD_SIZE,
    SegmentScan,
)
from protocol.errors import DrgateError
from protocol.modes import Mode

NAME = "drgate-capture"

_FIELDS = [
    ("segment", StringType()),  # path of the segment file
    ("complete", BooleanType()),  # the segment has its trailer (false: cut, the writer died)
    ("site", StringType()),
    ("node", IntegerType()),
    ("role", StringType()),  # egress | ingress | standby | unknown
    ("stream", StringType()),  # tapped | forwarded | ingested
    ("incarnation", LongType()),  # the capturing site's incarnation (u64 read as signed)
    ("wall_time", TimestampType()),
    ("wall_time_us", LongType()),  # microseconds since the Unix epoch
    ("cseq", LongType()),  # the capturing site's command sequence number
    ("origin_cseq", LongType()),  # ingested stream: the event's cseq at its origin (0: n/a)
    ("origin_incarnation", LongType()),  # ingested stream: the origin's incarnation (0: n/a)
    ("kind", IntegerType()),  # bus command kind number (protocol.cluster.Kind)
    ("kind_name", StringType()),
    ("mode", StringType()),  # none | wiring | enqueue | full
    ("rule_id", IntegerType()),  # null when no rule decided (the default mode applied)
    ("rule", StringType()),  # the rule's name; null when no rule decided
    ("queue", StringType()),  # null for a record that names no queue
    ("queue_index", IntegerType()),
    ("queue_count", IntegerType()),
    ("bytes", LongType()),  # encoded bus command size
    ("wire_bytes", LongType()),  # share of the compressed link batch (forwarded; 0: unknown)
    ("resync", BooleanType()),
    ("payload", BinaryType()),  # null unless option payloads=true and the record has one
]
SCHEMA = StructType([StructField(name, type_, nullable=True) for name, type_ in _FIELDS])
"""The data source's schema (documented in docs/analysis.md)."""

BATCH_ROWS = 1 << 16


class CaptureSourceError(DrgateError):
    """A capture path cannot be read (missing, or not a capture segment)."""


def _kind_names() -> list[str]:
    names = [f"kind-{i}" for i in range(256)]
    try:
        from protocol.cluster import Kind
    except ImportError:  # pragma: no cover - protocol.cluster is part of the project
        return names
    for kind in Kind:
        if 0 <= kind < 256:
            names[kind] = kind.name.lower()
    return names


# Hadoop's names for S3 (s3a://, s3n://) are S3 to pyarrow.
_SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3"}
SCHEMES = ("file", "s3", "s3a", "s3n", "gs", "gcs", "hdfs", "abfs", "abfss")
"""URI schemes a capture location may have (besides a plain path); see docs/analysis.md."""


def is_uri(location: str) -> bool:
    """True for ``scheme://...`` (a plain path, even with a colon, is not a URI)."""
    return "://" in location and location.split("://", 1)[0].isidentifier()


def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow file system of ``location`` and the path inside it.

    ``location`` is a plain path (made absolute: executors run elsewhere) or a
    URI with one of :data:`SCHEMES`.  Raises :class:`CaptureSourceError` for an
    unknown scheme or a file system that cannot be set up here.
    """
    if not is_uri(location):
        return pafs.LocalFileSystem(), os.path.abspath(location)
    scheme, rest = location.split("://", 1)
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise CaptureSourceError(
            f"capture location {location!r}: unknown scheme {scheme}://; use a path "
            f"readable by every executor (a shared file system) or one of "
            f"{', '.join(s + '://' for s in SCHEMES)}"
        )
    try:
        fs, path = pafs.FileSystem.from_uri(f"{_SCHEME_ALIASES.get(scheme, scheme)}://{rest}")
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise CaptureSourceError(
            f"capture location {location!r}: cannot open its file system here: {exc} "
            "(docs/analysis.md, 'Where the captures live', says what each scheme needs)"
        ) from None
    return fs, path


def _display(location: str, root_path: str, path: str) -> str:
    """How a segment found under ``location`` is named in the ``segment`` column."""
    if not is_uri(location):
        return path
    rel = path[len(root_path) :].lstrip("/")
    if not rel:
        return location
    parts = urlsplit(location)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + rel))


def is_segment(path: Path | str, fs: pafs.FileSystem | None = None) -> bool:
    """Whether the file starts like a capture segment (reads its first 6 bytes only)."""
    if fs is None:
        fs = pafs.LocalFileSystem()
    try:
        with fs.open_input_stream(str(path)) as fh:
            start = fh.read(len(MAGIC))
    except (OSError, pa.ArrowException):
        return False
    # An empty or partly written preamble is a segment cut at birth.
    return MAGIC.startswith(start) if len(start) < len(MAGIC) else start == MAGIC


@dataclass(frozen=True)
class SegmentPartition(InputPartition):
    """One segment: where it is (``root`` as loaded, ``path`` inside its file system)."""

    root: str
    path: str
    size: int
    segment: str  # the ``segment`` column: a path, or a URI under ``root``


def plan_segments(
    location: str | os.PathLike[str], glob: str = "*", *, fs: pafs.FileSystem | None = None
) -> list[SegmentPartition]:
    """One partition per segment under ``location`` (a file, a directory, or a URI).

    Runs on the driver and reads no segment: file sizes come from the listing,
    and only the first 6 bytes of each candidate file are read (the magic).
    Hidden files and folders (``.name``) are skipped.  Raises
    :class:`CaptureSourceError` when ``location`` does not exist.
    """
    root = os.fspath(location)
    own_fs, root_path = filesystem(root)
    if not is_uri(root):
        root = root_path
    fs = fs if fs is not None else own_fs
    info = fs.get_file_info(root_path)
    if info.type == pafs.FileType.File:
        return [SegmentPartition(root, root_path, info.size or 0, root)]
    if info.type != pafs.FileType.Directory:
        raise CaptureSourceError(
            f"capture path {root!r} does not exist; pass the directory the sidecars "
            "write their capture segments to (capture.directory in the sidecar config)"
        )
    found = []
    prefix = root_path.rstrip("/") + "/"
    for entry in fs.get_file_info(pafs.FileSelector(root_path, recursive=True)):
        if entry.type != pafs.FileType.File:
            continue
        rel = entry.path[len(prefix) :] if entry.path.startswith(prefix) else entry.base_name
        parts = rel.split("/")
        if any(p.startswith(".") for p in parts) or not fnmatch.fnmatch(parts[-1], glob):
            continue
        if is_segment(entry.path, fs):
            found.append(
                SegmentPartition(
                    root, entry.path, entry.size or 0, _display(root, root_path, entry.path)
                )
            )
    # files of a folder before its sub-folders, each level by name (as os.walk)
    found.sort(key=lambda p: (p.path.split("/")[:-1], p.path))
    return found


def list_segments(path: str | os.PathLike[str], glob: str = "*") -> list[str]:
    """The ``segment`` names of the segments under ``path`` (see :func:`plan_segments`)."""
    return [p.segment for p in plan_segments(path, glob)]


_HEAD_DTYPE = np.dtype([(name, kind) for name, kind in RECORD_HEAD_FIELDS])
assert _HEAD_DTYPE.itemsize == RECORD_HEAD_SIZE
_MODES = pa.array([m.label for m in sorted(Mode)], pa.string())
_ROLES = {"unknown", "egress", "ingress", "standby"}


def _constant(value: Any, n: int, type_: pa.DataType) -> pa.Array:
    return pc.take(pa.array([value], type_), pa.array(np.zeros(n, np.int32)))


def arrow_schema(schema: StructType = SCHEMA) -> pa.Schema:
    """The Arrow schema Spark expects for ``schema`` (timestamps in UTC)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


def segment_batches(
    location: str,
    schema: pa.Schema | None = None,
    *,
    payloads: bool = False,
    batch_rows: int = BATCH_ROWS,
) -> Iterator[pa.RecordBatch]:
    """Read one segment (a path or a URI) into Arrow batches of the data source's schema.

    Raises :class:`protocol.errors.RemoteProtocolError` for a corrupt segment;
    a cut segment yields its whole records with ``complete`` false.
    """
    fs, path = filesystem(location)
    name = location if is_uri(location) else path
    yield from _read_batches(fs, path, name, schema, payloads=payloads, batch_rows=batch_rows)


def _read_batches(
    fs: pafs.FileSystem,
    path: str,
    name: str,
    schema: pa.Schema | None,
    *,
    payloads: bool,
    batch_rows: int = BATCH_ROWS,
) -> Iterator[pa.RecordBatch]:
    if schema is None:
        schema = arrow_schema()
    with fs.open_input_file(path) as fh:
        data = fh.read()
    scan, head_rows = scan_segment_heads(data)
    if scan.header is None or scan.records == 0:
        return
    kind_names = pa.array(_kind_names(), pa.string())
    strings = pa.array(scan.strings, pa.string())
    buf = np.frombuffer(data, np.uint8)
    offsets = np.frombuffer(scan.record_offsets, np.uint64).astype(np.int64)
    heads = head_rows.view(_HEAD_DTYPE)[:, 0]
    for first in range(0, len(offsets), batch_rows):
        part = slice(first, first + batch_rows)
        yield _batch(
            data, buf, offsets[part], heads[part], scan, name, schema, kind_names, strings, payloads
        )


def _batch(
    data: bytes,
    buf: np.ndarray,
    offs: np.ndarray,
    heads: np.ndarray,
    scan: SegmentScan,
    path: str,
    schema: pa.Schema,
    kind_names: pa.Array,
    strings: pa.Array,
    payloads: bool,
) -> pa.RecordBatch:
    header = scan.header
    assert header is not None
    counts = heads["queue_count"].astype(np.int64)
    per_record = np.maximum(counts, 1)
    rows = int(per_record.sum())
    record = np.repeat(np.arange(len(offs)), per_record)
    starts = np.cumsum(per_record) - per_record
    queue_index = np.arange(rows, dtype=np.int64) - np.repeat(starts, per_record)
    has_queue = np.repeat(counts > 0, per_record)
    # queue ids: u32 big-endian right after the head
    qoff = offs[record] + RECORD_HEAD_SIZE + 4 * queue_index
    qoff = np.where(has_queue, qoff, 0)
    queue = pc.take(strings, pa.array(u32_at(buf, qoff).astype(np.int64), mask=~has_queue))

    def col(name: str, dtype: type = np.int64) -> np.ndarray:
        values: np.ndarray = heads[name].astype(dtype)[record]
        return values

    rule_id = col("rule_id", np.int32)
    no_rule = rule_id == NO_RULE
    wall = heads["wall_time_us"].astype(np.int64)[record]
    flags = col("flags", np.int32)
    if payloads:
        payload_len = col("payload_len")
        ends = offs[record] + RECORD_HEAD_SIZE + 4 * counts[record]
        has = (flags & 1).astype(bool)
        payload = pa.array(
            [
                data[e : e + n] if h else None
                for e, n, h in zip(ends.tolist(), payload_len.tolist(), has.tolist(), strict=True)
            ],
            pa.binary(),
        )
    else:
        payload = pa.nulls(rows, pa.binary())
    columns = {
        "segment": _constant(path, rows, pa.string()),
        "complete": _constant(scan.complete, rows, pa.bool_()),
        "site": _constant(header.site, rows, pa.string()),
        "node": _constant(header.node, rows, pa.int32()),
        "role": _constant(header.role.label, rows, pa.string()),
        "stream": _constant(header.stream.label, rows, pa.string()),
        "incarnation": _constant(
            np.array([header.incarnation], np.uint64).astype(np.int64)[0], rows, pa.int64()
        ),
        "wall_time": pa.array(wall, pa.timestamp("us", tz="UTC")),
        "wall_time_us": pa.array(wall),
        "cseq": pa.array(col("cseq")),
        "origin_cseq": pa.array(col("origin_cseq")),
        "origin_incarnation": pa.array(col("origin_incarnation")),
        "kind": pa.array(col("kind", np.int32)),
        "kind_name": pc.take(kind_names, pa.array(col("kind", np.int32))),
        "mode": pc.take(_MODES, pa.array(col("mode", np.int32))),
        "rule_id": pa.array(rule_id, mask=no_rule),
        "rule": pc.take(strings, pa.array(col("rule_name"), mask=no_rule)),
        "queue": queue,
        "queue_index": pa.array(queue_index.astype(np.int32)),
        "queue_count": pa.array(counts[record].astype(np.int32)),
        "bytes": pa.array(col("size")),
        "wire_bytes": pa.array(col("wire_size")),
        "resync": pa.array((flags & 2).astype(bool)),
        "payload": payload,
    }
    return pa.RecordBatch.from_arrays([columns[n] for n in schema.names], schema=schema)


class CaptureDataSource(DataSource):
    """``spark.read.format("drgate-capture")``: capture segments, one partition each."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return CaptureSourceReader(dict(self.options), schema)


def _bool_option(options: dict[str, str], key: str) -> bool:
    value = str(options.get(key, "false")).lower()
    if value not in {"true", "false"}:
        raise CaptureSourceError(f"option {key}={value!r}: use true or false")
    return value == "true"


class CaptureSourceReader(DataSourceReader):
    """Plans segments in :meth:`partitions` (driver) and reads them in :meth:`read` (executors)."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.path = options.get("path")
        if not self.path:
            raise CaptureSourceError('load a path: spark.read.format("drgate-capture").load(DIR)')
        self.glob = options.get("glob", "*")
        self.payloads = _bool_option(options, "payloads")
        self.schema = schema

    def partitions(self) -> list[InputPartition]:
        # The driver: one partition per segment, planned from the listing (sizes) and
        # each file's first bytes; no segment is read here.
        return list(plan_segments(self.path or "", self.glob))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # An executor, maybe on another machine: it opens the segment through the
        # location's own file system (the path must be shared, or a URI).
        assert isinstance(partition, SegmentPartition)
        fs, _ = filesystem(partition.root)
        schema = arrow_schema(self.schema)
        yield from _read_batches(
            fs, partition.path, partition.segment, schema, payloads=self.payloads
        )


def register(spark: Any) -> None:
    """Register the data source with a session (idempotent)."""
    spark.dataSource.register(CaptureDataSource)
