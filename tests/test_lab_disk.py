"""lab.lifetime.fill: a disk filled to the last byte (the chaos suite's
``spool-full`` fault), and freed again."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from lab.lifetime import fill
from tests.lab import mounted_tmpfs


def test_a_filled_disk_refuses_a_write_until_the_filler_goes(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "disk", size_bytes=1 << 20) as disk:
        (disk / "before").write_bytes(b"x" * 1000)
        filler = fill(disk)
        stat = os.statvfs(disk)
        assert stat.f_bavail == 0
        with pytest.raises(OSError) as exc:
            (disk / "more").write_bytes(b"y" * 8192)
        assert exc.value.errno == errno.ENOSPC
        filler.unlink()
        (disk / "more").write_bytes(b"y" * 8192)
