"""What every lab object that starts things shares: ``with`` starts it and
always stops it, also when starting failed halfway."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Self

# fill(): how often it measures the free space again when another writer
# took some of it between the measure and the allocation.
FILL_TRIES = 50


class MountError(RuntimeError):
    """A tmpfs could not be mounted (this machine, or this user, cannot)."""


@contextmanager
def tmpfs(path: Path, *, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted on ``path`` (created), unmounted on
    exit (a small disk to fill up); :class:`MountError` when it cannot be
    mounted (it needs root).  Stop the processes that use it before leaving."""
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)]
    done = subprocess.run(mount, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise MountError(f"cannot mount a tmpfs on {path} (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True, text=True, check=True)


def fill(disk: Path, name: str = "filler") -> Path:
    """Take every free byte of the filesystem at ``disk`` with one file (a
    disk that fills up); delete the file it returns to free them again."""
    filler = disk / name
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        for _ in range(FILL_TRIES):
            stat = os.statvfs(disk)
            free = stat.f_bavail * stat.f_frsize
            if not free:
                break
            try:
                os.posix_fallocate(fd, size, free)
            except OSError as exc:  # another writer took some meanwhile: again
                if exc.errno != errno.ENOSPC:
                    raise
                continue
            size += free
    finally:
        os.close(fd)
    return filler


class Started:
    """A context manager over ``start()`` and ``stop()``.

    ``with x:`` calls ``x.start()``; when that raises, ``x.stop()`` undoes
    what was made before the exception goes on (so ``stop`` must cope with a
    half-started object).  Leaving the block calls ``x.stop()``.
    """

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
