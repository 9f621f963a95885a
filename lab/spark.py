"""A standalone Spark cluster on this machine: one master and two workers, on loopback.

The master and the workers are started straight from the jars of the
installed ``pyspark`` package (``java -cp PYSPARK/jars/*
org.apache.spark.deploy.master.Master``, ``...deploy.worker.Worker``): no
Spark download and no ``sbin/`` scripts.  Each is a process of its own
session (``start_new_session``); the executors a worker launches for an
application are its children.  ``stop()`` stops the workers, then the
master, each by its pid (SIGTERM, then SIGKILL after
:data:`STOP_TIMEOUT_S`), and then any process still left in their sessions
(an executor its worker did not take down), again by pid.  Used as a context
manager it always cleans up, also when starting failed halfway.

A cluster is *ready* when the master's web UI JSON (``http://127.0.0.1:W/json/``)
lists every worker ``ALIVE``; waiting for it has a deadline.  The master's
URL is :attr:`SparkCluster.master_url` (``spark://127.0.0.1:P``).  Sizes are
small on purpose (the lab shares two cores): each worker offers
:data:`WORKER_CORES` core and :data:`WORKER_MEMORY` of memory, so one
executor of one core runs on each.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.lifetime import Started
from lab.site import free_port

# A master or worker that is not up (the master's JSON does not list every
# worker ALIVE) by then has failed to start: a JVM starts in seconds, the
# shared CI machine may make that tens of seconds.
START_TIMEOUT_S = 90.0
# How long a JVM gets to stop on SIGTERM before SIGKILL.
STOP_TIMEOUT_S = 15.0
POLL_S = 0.2  # between looks at the master's JSON (another process: no event to await)
# Each worker offers one core and enough memory for one small executor
# (ExecutorConfig below); the daemons themselves need little heap.
WORKER_CORES = 1
WORKER_MEMORY = "1g"
DAEMON_HEAP = "-Xmx256m"
MAIN_MASTER = "org.apache.spark.deploy.master.Master"
MAIN_WORKER = "org.apache.spark.deploy.worker.Worker"


class SparkLabError(RuntimeError):
    """The cluster could not start or misbehaved; the message names the log to read."""


def pyspark_home() -> Path:
    """The installed ``pyspark`` package's directory (it holds ``jars/``)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise SparkLabError("pyspark is not installed here; pip install 'drgate[analysis]'")
    home = Path(spec.origin).parent
    if not (home / "jars").is_dir():
        raise SparkLabError(f"{home} has no jars/ directory; is this a full pyspark install?")
    return home


def scala_version(home: Path) -> str:
    """The Scala version of the Spark jars under ``home`` (``2.13``), from spark-core's name."""
    for jar in sorted((home / "jars").glob("spark-core_*.jar")):
        return jar.name.removeprefix("spark-core_").split("-", 1)[0]
    raise SparkLabError(f"no spark-core jar in {home / 'jars'}; is this a full pyspark install?")


def java_binary() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise SparkLabError("no java on the PATH (Spark 4 needs Java 17 or 21); set JAVA_HOME")
    return found


@dataclass(frozen=True)
class ExecutorConfig:
    """What an application asks of the lab cluster: one 1-core executor per worker."""

    cores: int = 1
    memory: str = "512m"

    def spark_conf(self, workers: int) -> dict[str, str]:
        return {
            "spark.executor.cores": str(self.cores),
            "spark.executor.memory": self.memory,
            "spark.cores.max": str(self.cores * workers),
        }


@dataclass
class _Daemon:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid


def session_pids(sid: int) -> list[int]:
    """Pids of the live processes whose session id is ``sid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # fields after the command's closing parenthesis: state ppid pgrp session ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Process ``pid`` runs (exists and is not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class SparkCluster(Started):
    """A master and ``workers`` workers (see the module docstring)."""

    def __init__(self, *, workers: int = 2, workdir: str | Path | None = None) -> None:
        self.workers = workers
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="spark-lab-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.webui_port = 0
        self.daemons: list[_Daemon] = []
        self.executor = ExecutorConfig()
        self._sessions: list[int] = []

    # -- addresses -------------------------------------------------------------

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def json_url(self) -> str:
        return f"http://127.0.0.1:{self.webui_port}/json/"

    def spark_conf(self) -> dict[str, str]:
        """Settings a driver on this machine uses for the lab cluster."""
        return {
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            **self.executor.spark_conf(self.workers),
        }

    def worker_dir(self, n: int) -> Path:
        """Worker ``n``'s work directory: one folder per application it ran executors for."""
        return self.workdir / f"worker-{n}"

    # -- lifetime ----------------------------------------------------------------

    def start(self) -> None:
        home = pyspark_home()
        java = java_binary()
        env = {
            **os.environ,
            # The worker builds its executors' command line from SPARK_HOME's jars/.
            "SPARK_HOME": str(home),
            # ... and asks for a build directory unless told the Scala version
            # (the sbin/ scripts set it from the jars; so do we).
            "SPARK_SCALA_VERSION": scala_version(home),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOCAL_DIRS": str(self.workdir / "local"),
        }
        base = [java, DAEMON_HEAP, "-cp", str(home / "jars" / "*")]
        self.port, self.webui_port = free_port(), free_port()
        self._spawn(
            "master",
            [
                *base,
                MAIN_MASTER,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--webui-port",
                str(self.webui_port),
            ],
            env,
        )
        self.wait_workers(0)
        for n in range(1, self.workers + 1):
            self.worker_dir(n).mkdir(parents=True, exist_ok=True)
            self._spawn(
                f"worker-{n}",
                [
                    *base,
                    MAIN_WORKER,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(free_port()),
                    "--webui-port",
                    str(free_port()),
                    "--cores",
                    str(WORKER_CORES),
                    "--memory",
                    WORKER_MEMORY,
                    "--work-dir",
                    str(self.worker_dir(n)),
                    self.master_url,
                ],
                env,
            )
        self.wait_workers(self.workers)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log_path = self.workdir / f"{name}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                start_new_session=True,  # its executors stay in its session: found at stop
            )
        self.daemons.append(_Daemon(name, popen, log_path))
        self._sessions.append(popen.pid)

    def state(self) -> dict[str, Any]:
        """The master's web UI JSON (workers, applications); raises OSError while it is down."""
        with urllib.request.urlopen(self.json_url, timeout=5) as reply:
            state: dict[str, Any] = json.load(reply)
        return state

    def alive_workers(self) -> int:
        try:
            state = self.state()
        except (OSError, ValueError):
            return -1
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def wait_workers(self, count: int, *, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until the master answers and lists ``count`` ALIVE workers."""
        deadline = time.monotonic() + timeout
        while self.alive_workers() < count:
            for daemon in self.daemons:
                if daemon.popen.poll() is not None:
                    raise SparkLabError(
                        f"spark {daemon.name} exited with {daemon.popen.returncode}; "
                        f"log: {daemon.log_path}\n{self._tail(daemon)}"
                    )
            if time.monotonic() > deadline:
                logs = ", ".join(str(d.log_path) for d in self.daemons)
                raise SparkLabError(
                    f"the Spark master at {self.json_url} did not list {count} ALIVE "
                    f"worker(s) in {timeout:.0f} s; logs: {logs}"
                )
            time.sleep(POLL_S)

    @staticmethod
    def _tail(daemon: _Daemon) -> str:
        try:
            return daemon.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def pids(self) -> list[int]:
        """Every live process of the cluster: daemons and the executors they started."""
        found: list[int] = []
        for sid in self._sessions:
            found.extend(session_pids(sid))
        return sorted(set(found))

    def stop(self) -> None:
        """Stop the workers, then the master, by pid; then what is left of their sessions."""
        for daemon in reversed(self.daemons):  # workers first: the master sees them leave
            _terminate(daemon.popen)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        left = self.pids()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGTERM)
        while left and time.monotonic() < deadline:
            time.sleep(POLL_S)
            left = [pid for pid in left if alive(pid)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGKILL)
        self.daemons.clear()


def _terminate(popen: subprocess.Popen[bytes]) -> None:
    if popen.poll() is not None:
        return
    popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
