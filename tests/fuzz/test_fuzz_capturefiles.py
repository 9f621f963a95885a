"""Mutation fuzzing of the capture's reading of forwarded events
(gateway/capturefiles.py): whatever bytes the egress hands the capture as a
forwarded event, ``CaptureFiles.write`` skips what it cannot decode (naming
it in ``last_error``) and never raises, and the segment it writes reads back.
"""

from __future__ import annotations

from pathlib import Path

from gateway.captureconfig import CaptureConfig
from gateway.capturefiles import CaptureFiles
from protocol import cluster as pc
from protocol.capture import CaptureRole, scan_segment_untrusted
from protocol.modes import Mode
from tests.support.mutate import Mutator, fuzz

_EVENT = pc.Replicated(
    "P",
    7,
    41,
    2,
    99,
    (Mode.FULL, Mode.ENQUEUE, Mode.FULL),
    (
        pc.Enqueue("mirror", 5, b"body", "id-5", {"k": 1}),
        pc.QueueDeclare("work", {"qpid.max_count": 10}),
        pc.Dequeue("mirror", (1, 2)),
    ),
)
SEEDS = [pc.encode_frame([_EVENT]), pc.encode_frame([_EVENT, _EVENT])]


def _files(tmp_path: Path, *, payloads: bool) -> CaptureFiles:
    config = CaptureConfig(directory=str(tmp_path), payloads=payloads)
    return CaptureFiles(config, site="P", node=1, rule_of=lambda _queue: None)


def test_forwarded_events_never_break_the_capture(tmp_path: Path) -> None:
    files = _files(tmp_path, payloads=True)
    seq = 0

    def write(payload: bytes) -> None:
        nonlocal seq
        seq += 1
        files.write([("f", seq, seq, payload, 10)], CaptureRole.EGRESS, 7, 0.0, closing=False)

    def damaged(m: Mutator, data: bytes) -> bytes:
        return m.mutate(data, fields=[(2, 2), (8, 4)])

    fuzz("capture-forwarded", SEEDS, write, allowed=(), default_iterations=600, make_input=damaged)
    files.write([], CaptureRole.EGRESS, 7, 1.0, closing=True)
    assert files.records["forwarded"] > 0
    assert files.last_error.startswith("capture skipped an event")
    for path in tmp_path.glob("*.cap"):
        assert scan_segment_untrusted(path.read_bytes()).complete
