"""CPU per process from /proc, and py-spy profiles: what the end-to-end
benches (bench/e2e_bench.py, bench/peer_rabbitmq.py) print per process role.

* :class:`CpuMeter` reads user + system time (``/proc/PID/stat`` fields 14
  and 15) of each named process *and its descendants* at ``start`` and
  ``stop`` (a RabbitMQ node is a shell script whose Erlang VM is a child);
  the difference over the messages delivered is the cost per message, and
  the system part of it (``kernel``) is what the processes' system calls
  cost: socket sends and receives, epoll, the spool's writes.  It also
  counts their wake-ups (``wakeups``): the voluntary context switches of
  every thread (``/proc/PID/task/TID/status``), each a wait for I/O or a
  timer that ended: how many messages a turn of each process finds
  (docs/performance.md, eleventh round: below saturation the count alone
  does not decide the cost).
* :class:`Profiler` runs ``py-spy record --format raw --gil`` against
  processes while a burst runs (py-spy on the PATH, or
  ``PY_SPY=/path/to/py-spy``; none: no profile) and :func:`summarize` turns
  the collapsed stacks into the top functions by own and by cumulative share
  of the samples.  ``--gil`` keeps only the samples in which the process
  holds the GIL, i.e. runs Python: a socket call releases it.  Without it a
  third to two fifths of the egress's and the ingress's samples were in
  socket sends, while /proc put 3-11 % of all the processes' CPU in system
  time: a sender that wakes its peer on loopback is often preempted inside
  the send, runnable but off the CPU, and py-spy saw that as busy.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(parent pid, user seconds, system seconds) of ``pid``, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after it.
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
    return int(fields[1]), int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def _wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid`` (0 when it is gone)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # the thread ended
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def tree_cpu(pids: dict[str, int]) -> dict[str, tuple[float, float, int]]:
    """(user, system) CPU seconds and wake-ups of each named process and its
    living descendants."""
    stats: dict[int, tuple[int, float, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = _stat(int(entry))
            if found is not None:
                stats[int(entry)] = found
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, _user, _system) in stats.items():
        children[ppid].append(pid)
    result = {}
    for name, root in pids.items():
        user = system = 0.0
        wakeups = 0
        todo = [root]
        while todo:
            pid = todo.pop()
            if pid in stats:
                user += stats[pid][1]
                system += stats[pid][2]
                wakeups += _wakeups(pid)
            todo.extend(children.get(pid, ()))
        result[name] = (user, system, wakeups)
    return result


class CpuMeter:
    """CPU seconds each named process (tree) spent between start and stop;
    ``kernel``: the system part of them, ``wakeups``: how many times its
    threads woke, after ``stop``.  /proc keeps a thread's switches only
    while it lives: one that ends in between (trio's idle worker threads
    end after 10 s) takes its count with it, so a figure may be a little
    low, never high."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._before: dict[str, tuple[float, float, int]] = {}
        self.kernel: dict[str, float] = {}
        self.wakeups: dict[str, int] = {}

    def start(self) -> None:
        self._before = tree_cpu(self.pids)

    def stop(self) -> dict[str, float]:
        after = tree_cpu(self.pids)
        spent = {}
        for name in self.pids:
            user, system, wakeups = after[name]
            user0, system0, wakeups0 = self._before.get(name, (0.0, 0.0, 0))
            spent[name] = user - user0 + system - system0
            self.kernel[name] = system - system0
            self.wakeups[name] = wakeups - wakeups0
        return spent

    def kernel_share(self, spent: dict[str, float]) -> float:
        """The system part of all of ``spent`` (what ``stop`` returned)."""
        return sum(self.kernel.values()) / max(1e-9, sum(spent.values()))


def py_spy() -> str | None:
    """The py-spy executable, or None."""
    return os.environ.get("PY_SPY") or shutil.which("py-spy")


class Profiler:
    """``py-spy record`` (raw collapsed stacks, 250 Hz, non-blocking) on
    each named pid from ``start`` until ``stop``."""

    def __init__(self, pids: dict[str, int], outdir: Path) -> None:
        self.pids = pids
        self.outdir = outdir
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> bool:
        exe = py_spy()
        if exe is None:
            return False
        self.outdir.mkdir(parents=True, exist_ok=True)
        for name, pid in self.pids.items():
            argv = [exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "250"]
            argv += ["--nonblocking", "--gil", "--output", str(self.outdir / f"{name}.txt")]
            self._procs[name] = subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        return True

    def stop(self) -> dict[str, Path]:
        """Stop each recorder (SIGINT: it writes its file) and return the files."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        files = {}
        for name, proc in self._procs.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            path = self.outdir / f"{name}.txt"
            if path.exists():
                files[name] = path
        return files


def _short(frame: str) -> str:
    """``func (path/to/module.py:123)`` -> ``module.py:func``."""
    func, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(file).parts
    tail = "/".join(parts[-2:]) if len(parts) >= 2 else file
    return f"{tail}:{func}"


Shares = list[tuple[str, float]]


# A sample whose innermost frame is one of these is the event loop waiting
# for I/O (py-spy records it; the thread is mostly asleep in epoll_wait).
IDLE_LEAVES = ("_io_epoll.py:EpollIOManager.get_events",)
ROOT_SHARE = 0.9


def summarize(path: Path, top: int = 12) -> tuple[int, int, Shares, Shares]:
    """Samples, samples waiting in the event loop, and the top functions by
    own and by cumulative share (%) of the other samples, of a py-spy raw
    file (``frame;frame;... count`` per line, root first)."""
    own: collections.Counter[str] = collections.Counter()
    cumulative: collections.Counter[str] = collections.Counter()
    total = idle = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(f) for f in stack.split(";") if f and not f.startswith("process ")]
        if not frames:
            continue
        if frames[-1].endswith(IDLE_LEAVES):
            idle += count
            continue
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            cumulative[frame] += count
    if not total:
        return idle, idle, [], []

    def share(counter: collections.Counter[str]) -> Shares:
        return [(name, 100.0 * n / total) for name, n in counter.most_common(top)]

    # The roots every busy sample runs under (runpy, the CLI, trio's run
    # loop) say nothing: left out of the cumulative column.
    for name, n in list(cumulative.items()):
        if n >= ROOT_SHARE * total:
            del cumulative[name]
    return total + idle, idle, share(own), share(cumulative)


def profile_table(name: str, path: Path, top: int = 12) -> str:
    """A markdown summary of one profile."""
    total, idle, own, cumulative = summarize(path, top)
    busy = total - idle
    lines = [f"#### {name}: {busy} busy samples of {total} ({idle} waiting in epoll left out)", ""]
    lines.append("| own % | function | | cumulative % | function |")
    lines.append("|---:|---|---|---:|---|")
    for i in range(max(len(own), len(cumulative))):
        o = own[i] if i < len(own) else ("", 0.0)
        c = cumulative[i] if i < len(cumulative) else ("", 0.0)
        lines.append(f"| {o[1]:.1f} | `{o[0]}` | | {c[1]:.1f} | `{c[0]}` |")
    return "\n".join(lines)
