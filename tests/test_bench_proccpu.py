"""bench/proccpu.py counts a process's wake-ups: the voluntary context
switches of every one of its threads, and of its children's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from proccpu import CpuMeter

# Waits for its stdin, then a thread of its own and a child process pass a
# byte back and forth 100 times over pipes: in each round one of them waits
# for the other (which one depends on the scheduler), and both stay alive
# until the end: 80 wake-ups at least, with room for rounds in which neither
# waited; the main thread alone waits only a few times.
NAPPER = """
import os, subprocess, sys, threading
CHILD = "import os\\nfor _ in range(100): os.write(1, os.read(0, 1))\\nos.read(0, 1)"
sys.stdin.readline()
passed, done = threading.Event(), threading.Event()
pipe = subprocess.PIPE
child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=pipe, stdout=pipe, bufsize=0)
def pass_bytes():
    for _ in range(100):
        child.stdin.write(b"x")
        assert child.stdout.read(1) == b"x"
    passed.set()
    done.wait()
worker = threading.Thread(target=pass_bytes)
worker.start()
passed.wait()
print("napped", flush=True)
sys.stdin.readline()
done.set()
worker.join()
child.communicate(b"\\n")
"""


def test_the_wake_ups_of_every_thread_and_child_are_counted() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", NAPPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            meter = CpuMeter({"napper": proc.pid})
            meter.start()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "napped\n"
            meter.stop()
            assert meter.wakeups["napper"] >= 80, "a thread's or a child's waits were not counted"
            proc.stdin.write("end\n")
            proc.stdin.flush()
            proc.wait(timeout=30)
        finally:
            proc.kill()
