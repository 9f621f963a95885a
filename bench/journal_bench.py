"""What the broker journal (cluster/journal.py) costs, and how long a restart takes.

(a) Commit throughput: frames of 100 publishes of 100 B, appended and
    committed one frame per commit and ten frames per commit, with
    ``fsync: batch`` and ``never``: records (frames) and messages per second,
    MB/s of journal, and the latency of each commit's fdatasync (p50, p99).
(b) Restart: a journal holding 1,000,000 durable messages (publishes of
    100 B to four queues in frames of 100, one consumer taking and accepting
    a tenth of them as it goes).  Printed: ``recover()`` seconds from the
    journal alone (no checkpoint: every frame replayed), with the default
    checkpoint policy (64 MiB: a checkpoint plus the journal after it), and
    from a checkpoint taken at the end (nothing to replay); and the bytes on
    disk against the live data (the bodies of the messages still queued, and
    the state snapshot).

    .venv/bin/python bench/journal_bench.py [--messages 1000000] [--dir /var/tmp]

The journal lives in a temporary directory (``--dir`` to put it on the disk
a broker would use: the fdatasync figures are the disk's).  Measured on ext4
on a virtual disk, two cores shared with other engineers' test runs (load
average 6 to 8, so the CPU-bound figures are about a third of an idle
machine's: encoding one frame of 100 publishes took 4.4 ms in the same
minutes):

    commit fsync=batch  1 frame/commit      204 records/s   20,354 msg/s   2.8 MB/s
                                            fdatasync p50 3.38 ms, p99 18.5 ms
    commit fsync=batch 10 frames/commit     580 records/s   57,972 msg/s   7.9 MB/s
                                            fdatasync p50 3.12 ms, p99 18.3 ms
    commit fsync=never  1 frame/commit      519 records/s   51,894 msg/s   7.0 MB/s
    commit fsync=never 10 frames/commit     996 records/s   99,611 msg/s  13.5 MB/s

    1,000,000 messages published, 100,000 consumed: 900,000 live, 90 MB of
    bodies, a state snapshot of 118 MB
    recover, journal only (11,002 frames, 137 MB on disk)              25.3 s
    recover, checkpoints every 64 MiB (checkpoint at cseq 981,764
             + 223 frames, 118 MB on disk)                              2.4 s
    recover, checkpoint at the end (nothing replayed, 118 MB)          2.5 s
    disk / live bodies: journal only 1.52, default checkpoints 1.31,
                        after a checkpoint 1.31

Most of a commit's cost is encoding the frame (``append``); a node that
journals a delivered frame unchanged passes its bytes to ``append_frame``.
One fdatasync per commit is what group commit buys: ten frames per commit
cost about the same sync as one.  Replaying costs about 25 µs per message
here (decode + apply), restoring a checkpoint under 3 µs per live message,
so checkpoints turn a restart of minutes into seconds; with the default
policy the disk holds the last checkpoint and at most 64 MiB of journal.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cluster import state as st
from cluster.journal import DEFAULT_CHECKPOINT_BYTES, Journal
from protocol import cluster as pc

BODY = 100
PER_FRAME = 100
QUEUES = ("q0", "q1", "q2", "q3")
SESSION = 1 << 40
NO_CHECKPOINT = 1 << 62


@contextmanager
def journal_dir(base: Path, label: str) -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix=f"journal-{label}-", dir=base))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def publishes(queue: str, first: int) -> list[pc.Command]:
    body = b"b" * BODY
    durable = {pc.DURABLE_PROPERTY: True}  # persistent: kept whole by checkpoints
    return [pc.Publish("", queue, body, f"m-{first + i}", durable) for i in range(PER_FRAME)]


def percentile_ms(samples: list[float], p: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[p - 1] * 1e3


def commit_throughput(base: Path, fsync: str, frames_per_commit: int, frames: int) -> None:
    with journal_dir(base, fsync) as directory, Journal.open(directory, fsync=fsync) as j:
        j.append(1, [pc.Genesis("site-p", 7), pc.QueueDeclare("q0", {"durable": True})])
        j.commit()
        cseq = 3
        syncs: list[float] = []
        start = time.perf_counter()
        for k in range(frames):
            j.append(cseq, publishes("q0", cseq))
            cseq += PER_FRAME
            if (k + 1) % frames_per_commit == 0:
                j.commit()
                syncs.append(j.statistics().fsync_last_seconds)
        j.commit()
        seconds = time.perf_counter() - start
        mb = j.statistics().bytes_since_checkpoint / 1e6
    line = (
        f"commit fsync={fsync:<5} {frames_per_commit:>2} frames/commit "
        f"{frames / seconds:>8,.0f} records/s {frames * PER_FRAME / seconds:>10,.0f} msg/s "
        f"{mb / seconds:>6.1f} MB/s"
    )
    if fsync == "batch":
        p50, p99 = percentile_ms(syncs, 50), percentile_ms(syncs, 99)
        line += f"  fdatasync p50 {p50:.2f} ms p99 {p99:.2f} ms"
    print(line, flush=True)


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.name != "journal.lock")


def build(messages: int, plain: Journal, policed: Journal) -> st.SiteState:
    """Feed both journals the same stream; ``policed`` checkpoints when it asks."""
    state = st.new_state()

    def frame(commands: list[pc.Command]) -> None:
        first = state.cseq + 1
        st.apply_all(state, commands)
        encoded = pc.encode_frame(commands)
        for j in (plain, policed):
            j.append_frame(first, encoded, len(commands))
            j.commit()
        if policed.needs_checkpoint:
            policed.checkpoint(state)

    frame([pc.Genesis("site-p", 7), pc.SessionOpen(SESSION)])
    frame([pc.QueueDeclare(q, {"durable": True}) for q in QUEUES])
    for k in range(messages // PER_FRAME):
        queue = QUEUES[k % len(QUEUES)]
        frame(publishes(queue, k * PER_FRAME))
        if k % 10 == 9:  # a consumer takes a tenth of what was published
            q = state.queues[QUEUES[(k // 10) % len(QUEUES)]]
            positions = tuple(itertools.islice(q.messages, PER_FRAME))
            frame(
                [pc.Acquire(q.name, SESSION, 0, PER_FRAME), pc.Accept(q.name, SESSION, positions)]
            )
    return state


def timed_recover(directory: Path, want: str) -> tuple[float, int, int]:
    with Journal.open(directory) as j:
        result = j.recover()
    assert result is not None
    assert st.digest(result.state) == want, "recovered state differs"
    return result.seconds, result.frames_replayed, result.checkpoint_cseq


def restart(base: Path, messages: int) -> None:
    with (
        journal_dir(base, "plain") as plain_dir,
        journal_dir(base, "policed") as policed_dir,
    ):
        with (
            Journal.open(plain_dir, fsync="never", checkpoint_bytes=NO_CHECKPOINT) as plain,
            Journal.open(policed_dir, fsync="never") as policed,
        ):
            start = time.perf_counter()
            state = build(messages, plain, policed)
            print(f"built the journals in {time.perf_counter() - start:.1f} s", flush=True)
        live = sum(len(q.messages) for q in state.queues.values())
        live_bytes = sum(q.bytes for q in state.queues.values())
        snapshot_bytes = len(st.snapshot(state))
        want = st.digest(state)
        plain_disk, policed_disk = disk_bytes(plain_dir), disk_bytes(policed_dir)
        del state
        print(
            f"{messages:,} messages published, {messages - live:,} consumed "
            f"({live:,} live, {live_bytes / 1e6:.0f} MB of bodies; "
            f"state snapshot {snapshot_bytes / 1e6:.0f} MB)"
        )
        seconds, frames, _ = timed_recover(plain_dir, want)
        print(
            f"recover, journal only ({frames:,} frames, {plain_disk / 1e6:.0f} MB)"
            f"{seconds:>12.1f} s"
        )
        seconds, frames, ckpt = timed_recover(policed_dir, want)
        print(
            f"recover, checkpoints every {DEFAULT_CHECKPOINT_BYTES >> 20} MiB (checkpoint at "
            f"cseq {ckpt:,} + {frames:,} frames, {policed_disk / 1e6:.0f} MB){seconds:>8.1f} s"
        )
        with Journal.open(policed_dir) as j:
            result = j.recover()
            assert result is not None
            j.checkpoint(result.state)
            del result
        end_disk = disk_bytes(policed_dir)
        seconds, frames, _ = timed_recover(policed_dir, want)
        print(
            f"recover, checkpoint at the end ({frames} frames, {end_disk / 1e6:.0f} MB)"
            f"{seconds:>14.1f} s"
        )
        print(
            f"disk / live bodies: journal only {plain_disk / live_bytes:.2f}, "
            f"default checkpoints {policed_disk / live_bytes:.2f}, "
            f"after a checkpoint {end_disk / live_bytes:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--frames", type=int, default=2000, help="frames per throughput run")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    for fsync in ("batch", "never"):
        for per_commit in (1, 10):
            commit_throughput(args.dir, fsync, per_commit, args.frames)
    restart(args.dir, args.messages)


if __name__ == "__main__":
    main()
