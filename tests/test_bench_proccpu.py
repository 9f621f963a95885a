"""bench/proccpu.py counts a process's wake-ups: the voluntary context
switches of every one of its threads, and of its children's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from proccpu import CpuMeter

# Waits for its stdin, then sleeps 40 times in a thread of its own and 40
# times in a child process, both alive until the end: at least 80 wake-ups,
# none of them in the main thread's count.
NAPPER = """
import subprocess, sys, threading, time
CHILD = "import time\\nfor _ in range(40): time.sleep(0.001)\\nprint(flush=True)\\ninput()"
sys.stdin.readline()
napped, done = threading.Event(), threading.Event()
def nap():
    for _ in range(40):
        time.sleep(0.001)
    napped.set()
    done.wait()
worker = threading.Thread(target=nap)
worker.start()
pipe = subprocess.PIPE
child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=pipe, stdout=pipe)
child.stdout.readline()
napped.wait()
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
            assert meter.wakeups["napper"] >= 80, "a thread's or a child's naps were not counted"
            proc.stdin.write("end\n")
            proc.stdin.flush()
            proc.wait(timeout=30)
        finally:
            proc.kill()
