"""analysis.source: the drgate-capture data source."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from analysis.source import (
    SCHEMA,
    CaptureSourceError,
    arrow_schema,
    list_segments,
    plan_segments,
    segment_batches,
)
from protocol.capture import NO_RULE, CaptureRecord, CaptureRole, SegmentHeader, Stream
from protocol.errors import RemoteProtocolError
from protocol.modes import Mode
from tests.analysis.twosite import segment_bytes

HEADER = SegmentHeader("dr", 3, CaptureRole.INGRESS, Stream.INGESTED, 0, 2**64 - 1, payloads=True)
RECORDS = [
    CaptureRecord(
        1_000_000, 10, 7, Mode.FULL, ("a", "b"), 100, 0, 5, 2**63 + 1, 4, "r4", False, b"xy"
    ),
    CaptureRecord(2_000_000, 11, 3, Mode.WIRING, (), 50, 0, 6, 2**63 + 1, NO_RULE, "", True),
    CaptureRecord(3_000_000, 12, 200, Mode.NONE, ("c",), 70),
]


def write(
    path: Path, header: SegmentHeader = HEADER, records: list[CaptureRecord] = RECORDS
) -> None:
    path.write_bytes(segment_bytes(header, records, end_us=9_000_000))


def test_batches_one_row_per_queue(tmp_path: Path) -> None:
    write(tmp_path / "s.cap")
    (batch,) = segment_batches(str(tmp_path / "s.cap"), arrow_schema(), payloads=True)
    rows = batch.to_pylist()
    assert [(r["cseq"], r["queue"], r["queue_index"], r["queue_count"]) for r in rows] == [
        (10, "a", 0, 2),
        (10, "b", 1, 2),
        (11, None, 0, 0),
        (12, "c", 0, 1),
    ]
    first = rows[0]
    assert first["site"] == "dr" and first["node"] == 3
    assert first["role"] == "ingress" and first["stream"] == "ingested"
    assert first["complete"] is True
    assert first["incarnation"] == -1  # u64 all ones, read as signed 64-bit
    assert first["origin_incarnation"] == -(2**63) + 1
    assert first["origin_cseq"] == 5
    assert first["kind_name"] == "publish" and first["mode"] == "full"
    assert first["rule_id"] == 4 and first["rule"] == "r4"
    assert first["payload"] == b"xy" and rows[1]["payload"] == b"xy"
    assert first["wall_time_us"] == 1_000_000
    assert rows[2]["rule_id"] is None and rows[2]["rule"] is None and rows[2]["resync"] is True
    assert rows[3]["kind_name"] == "kind-200" and rows[3]["payload"] is None


def test_listing_skips_other_files_and_refuses_missing_path(tmp_path: Path) -> None:
    write(tmp_path / "a.cap")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "b.seg")
    (tmp_path / "notes.txt").write_text("not a segment")
    (tmp_path / "empty.cap").write_bytes(b"")  # a segment cut at birth
    found = [Path(p).name for p in list_segments(tmp_path)]
    assert found == ["a.cap", "empty.cap", "b.seg"]
    assert [Path(p).name for p in list_segments(tmp_path, "*.cap")] == ["a.cap", "empty.cap"]
    with pytest.raises(CaptureSourceError, match="does not exist"):
        list_segments(tmp_path / "nope")


class CountingHandler(pafs.FileSystemHandler):
    """The local file system, counting the bytes read through it per file."""

    def __init__(self) -> None:
        self.local = pafs.LocalFileSystem()
        self.read: dict[str, int] = {}

    def _counted(self, path: str) -> pa.NativeFile:
        handler = self

        class Counting(io.RawIOBase):
            def __init__(self) -> None:
                self.inner = open(path, "rb")  # noqa: SIM115 - closed with the stream

            def close(self) -> None:
                self.inner.close()
                super().close()

            def readable(self) -> bool:
                return True

            def readinto(self, buffer: Any) -> int:
                n = self.inner.readinto(buffer)
                handler.read[path] = handler.read.get(path, 0) + n
                return n

        return pa.PythonFile(io.BufferedReader(Counting(), buffer_size=8), mode="r")

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self._counted(path)

    def open_input_file(self, path: str) -> pa.NativeFile:
        return self._counted(path)

    def get_type_name(self) -> str:
        return "counting"

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.local.get_file_info(paths)  # type: ignore[no-any-return]

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.local.get_file_info(selector)  # type: ignore[no-any-return]

    def _unused(self, *args: Any) -> Any:  # writing: never done by the planner
        raise NotImplementedError

    copy_file = create_dir = delete_dir = delete_dir_contents = delete_file = _unused
    delete_root_dir_contents = move = open_append_stream = open_output_stream = _unused

    def equals(self, other: Any) -> bool:
        return other is self


def test_planning_reads_only_the_magic_of_each_file(tmp_path: Path) -> None:
    """The driver plans one partition per segment from sizes and first bytes only."""
    many = [RECORDS[0]] * 2000
    write(tmp_path / "big.cap", records=many)
    write(tmp_path / "small.cap")
    (tmp_path / "notes.txt").write_text("not a segment " * 100)
    handler = CountingHandler()
    planned = plan_segments(tmp_path, fs=pafs.PyFileSystem(handler))
    assert [Path(p.path).name for p in planned] == ["big.cap", "small.cap"]
    assert [p.size for p in planned] == [
        (tmp_path / "big.cap").stat().st_size,
        (tmp_path / "small.cap").stat().st_size,
    ]
    assert (tmp_path / "big.cap").stat().st_size > 100_000
    # the 6 magic bytes (buffered by at most 8) of each file, nothing more
    assert handler.read and max(handler.read.values()) <= 8, handler.read


def test_file_uri_and_plain_path_name_the_same_segments(tmp_path: Path) -> None:
    write(tmp_path / "a.cap")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "b.cap")
    uri = tmp_path.as_uri()
    assert list_segments(uri) == [f"{uri}/a.cap", f"{uri}/sub/b.cap"]
    assert list_segments(tmp_path) == [str(tmp_path / "a.cap"), str(tmp_path / "sub" / "b.cap")]
    (batch,) = segment_batches(f"{uri}/a.cap")
    assert set(batch.column("segment").to_pylist()) == {f"{uri}/a.cap"}
    assert batch.num_rows == 4


def test_unknown_scheme_and_missing_uri_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CaptureSourceError, match=r"unknown scheme ftp://.*file://"):
        list_segments("ftp://host/captures")
    with pytest.raises(CaptureSourceError, match="does not exist"):
        list_segments((tmp_path / "nope").as_uri())


def test_relative_path_is_planned_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Executors run in other working directories: partitions carry absolute paths."""
    write(tmp_path / "a.cap")
    monkeypatch.chdir(tmp_path)
    (planned,) = plan_segments("a.cap")
    assert planned.path == str(tmp_path / "a.cap") and planned.segment == planned.path


def test_corrupt_segment_fails_with_protocol_error(tmp_path: Path) -> None:
    write(tmp_path / "s.cap")
    data = bytearray((tmp_path / "s.cap").read_bytes())
    data[60] ^= 0x10
    (tmp_path / "s.cap").write_bytes(bytes(data))
    with pytest.raises(RemoteProtocolError):
        list(segment_batches(str(tmp_path / "s.cap")))


@pytest.mark.spark
def test_spark_reads_segments_one_partition_each(spark: Any, tmp_path: Path) -> None:
    write(tmp_path / "one.cap")
    write(tmp_path / "two.cap", records=RECORDS[:1])
    cut = segment_bytes(HEADER, RECORDS, end_us=None)[:-3]  # cut inside the last record
    (tmp_path / "three.cap").write_bytes(cut)
    df = spark.read.format("drgate-capture").option("payloads", "true").load(tmp_path.as_uri())
    assert df.schema == SCHEMA
    assert df.rdd.getNumPartitions() == 3
    rows = df.select("segment", "complete", "cseq", "queue").collect()
    per_segment: dict[str, list[tuple[int, str | None]]] = {}
    complete = {}
    for r in rows:
        name = Path(r.segment).name
        per_segment.setdefault(name, []).append((r.cseq, r.queue))
        complete[name] = r.complete
    assert sorted(per_segment["one.cap"]) == [(10, "a"), (10, "b"), (11, None), (12, "c")]
    assert per_segment["two.cap"] == [(10, "a"), (10, "b")]
    assert sorted(per_segment["three.cap"], key=str) == [(10, "a"), (10, "b"), (11, None)]
    assert complete == {"one.cap": True, "two.cap": True, "three.cap": False}
