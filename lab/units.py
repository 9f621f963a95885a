"""Systemd unit files, read and run without systemd: the lab's ``systemctl``.

Where PID 1 is not systemd (containers, this lab), ``systemctl`` and
``systemd-run`` cannot start anything.  The namespace lab runs the shipped
units (deploy/systemd/) with this stand-in instead, which honours what the
units say about *running* a service and nothing of their sandboxing:

* ``ExecStart`` with ``%i`` (the instance) and ``$VAR``/``${VAR}`` from
  ``Environment=`` and ``EnvironmentFile=`` (``-`` prefix: optional);
* ``User=`` and ``Group=`` (the process runs as them, supplementary groups
  of the user included), ``WorkingDirectory=``;
* ``Restart=on-failure`` and ``RestartSec=`` (a supervisor process per
  unit restarts an exit with a non-zero status or a signal other than the
  stop signal), ``StartLimitBurst=`` within ``StartLimitIntervalSec=``;
* ``KillSignal=`` and ``TimeoutStopSec=`` on stop (then SIGKILL).

Ignored, and therefore not tested by the lab: the hardening options
(``ProtectSystem``, ``PrivateTmp``...; ``systemd-analyze verify`` and
``security --offline`` check those files, tests/deploy/test_systemd.py),
``Type=notify`` readiness (a unit is started once its process is), ordering
(commands run in the order given) and ``[Install]``.

Units are looked up in /etc/systemd/system, then /lib/systemd/system; state
(the supervisor's pid, the service's output) lives in ``/run/drgate-units``,
so a private ``/run`` per lab node keeps the nodes apart.  Usage, as
``systemctl``: ``python -m lab.units enable --now UNIT...``, ``start``,
``stop``, ``restart``, ``is-active``, ``status`` (prints the log's tail),
``daemon-reload`` (nothing to do).
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

UNIT_DIRS = (Path("/etc/systemd/system"), Path("/lib/systemd/system"))
STATE_DIR = Path("/run/drgate-units")
# systemd's defaults for what a unit leaves out.
DEFAULT_TIMEOUT_STOP_S = 90.0
DEFAULT_RESTART_S = 0.1
DEFAULT_START_LIMIT_INTERVAL_S = 10.0
DEFAULT_START_LIMIT_BURST = 5
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}
_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


class UnitError(RuntimeError):
    """A unit cannot be found, read or run; the message names it and the fix."""


def parse_seconds(text: str | None, default: float = 0.0) -> float:
    """A systemd time span (``10s``, ``2min 5s``, ``500ms``, ``5``) in seconds."""
    if text is None:
        return default
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text.strip()):
        if unit not in _UNITS and unit != "":
            raise UnitError(f"time span {text!r}: unknown unit {unit!r}")
        total += float(number) * _UNITS.get(unit, 1.0)
    return total


@dataclass
class UnitFile:
    """A unit file's settings: (section, key) -> the values, in order."""

    path: Path
    settings: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> UnitFile:
        unit = cls(path)
        section = ""
        for number, raw in enumerate(path.read_text().splitlines(), start=1):
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise UnitError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
            unit.settings.setdefault((section, key.strip()), []).append(value.strip())
        return unit

    def value(self, section: str, key: str) -> str | None:
        """The last value of ``key`` (an empty assignment resets: None)."""
        values = self.settings.get((section, key), [])
        return values[-1] if values and values[-1] != "" else None

    def words(self, section: str, key: str) -> list[str]:
        """Every value of ``key``, split on whitespace (list-valued settings)."""
        return [w for v in self.settings.get((section, key), []) for w in v.split()]

    def environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for spec in self.settings.get(("Service", "EnvironmentFile"), []):
            optional = spec.startswith("-")
            path = Path(spec.removeprefix("-"))
            if not path.exists():
                if optional:
                    continue
                raise UnitError(f"{self.path}: EnvironmentFile {path} does not exist")
            for line in path.read_text().splitlines():
                key, sep, value = line.strip().partition("=")
                if sep and not key.startswith("#"):
                    env[key.strip()] = value.strip().strip('"')
        for spec in self.settings.get(("Service", "Environment"), []):
            for assignment in shlex.split(spec):
                key, _, value = assignment.partition("=")
                env[key] = value
        return env

    def exec_start(self, *, instance: str = "", env: dict[str, str] | None = None) -> list[str]:
        """``ExecStart`` as an argv: ``%i`` replaced by ``instance`` and
        ``$VAR`` by ``env`` (a variable alone as a word splits into words,
        as systemd does; an unknown one is empty)."""
        line = self.value("Service", "ExecStart")
        if line is None:
            raise UnitError(f"{self.path}: no ExecStart")
        line = line.lstrip("-@:+!").replace("%i", instance).replace("%%", "%")
        values = env or {}
        argv: list[str] = []
        for word in shlex.split(line):
            alone = _VAR.fullmatch(word)
            if alone:
                argv += values.get(alone.group(1) or alone.group(2), "").split()
            else:
                argv.append(_VAR.sub(lambda m: values.get(m.group(1) or m.group(2), ""), word))
        return argv


def find_unit(name: str) -> tuple[UnitFile, str]:
    """The unit file of ``name`` (``drgate-broker@broker`` or with
    ``.service``) and its instance."""
    if not name.endswith(".service"):
        name += ".service"
    template, instance = name, ""
    if "@" in name:
        prefix, _, rest = name.partition("@")
        instance = rest.removesuffix(".service")
        template = f"{prefix}@.service"
    for folder in UNIT_DIRS:
        for candidate in (folder / name, folder / template):
            if candidate.exists():
                return UnitFile.read(candidate), instance
    raise UnitError(
        f"unit {name} not found in {', '.join(map(str, UNIT_DIRS))}: install its file there"
    )


def _pid_file(name: str) -> Path:
    return STATE_DIR / f"{name.removesuffix('.service')}.pid"


def log_path(name: str) -> Path:
    """Where unit ``name``'s output goes (its journal, here)."""
    return STATE_DIR / f"{name.removesuffix('.service')}.log"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def supervisor_pid(name: str) -> int | None:
    """The pid of unit ``name``'s supervisor when it runs, else None."""
    try:
        pid = int(_pid_file(name).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _alive(pid) else None


def start(name: str) -> None:
    """Start unit ``name`` under a supervisor of its own, unless it runs."""
    find_unit(name)  # fail here, in the caller, when it does not exist
    if supervisor_pid(name) is not None:
        return
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with log_path(name).open("ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "lab.units", "_supervise", name],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ),
        )
    _pid_file(name).write_text(str(supervisor.pid))


def stop(name: str) -> None:
    """Stop unit ``name``: its supervisor stops the service as the unit says
    (KillSignal, TimeoutStopSec, then SIGKILL) and exits."""
    pid = supervisor_pid(name)
    if pid is None:
        return
    unit, _ = find_unit(name)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _stop_timeout(unit) + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # another session's process: no event to wait on
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    _pid_file(name).unlink(missing_ok=True)


def _stop_timeout(unit: UnitFile) -> float:
    return parse_seconds(unit.value("Service", "TimeoutStopSec"), DEFAULT_TIMEOUT_STOP_S)


@dataclass(frozen=True)
class _Credentials:
    """Whom a unit's process runs as (``User=``/``Group=``; None: as we do)."""

    user: int | None = None
    group: int | None = None
    extra_groups: list[int] | None = None
    env: dict[str, str] = field(default_factory=dict)


def _credentials(unit: UnitFile) -> _Credentials:
    user = unit.value("Service", "User")
    if user is None:
        return _Credentials()
    entry = pwd.getpwnam(user)
    group = unit.value("Service", "Group")
    gid = grp.getgrnam(group).gr_gid if group else entry.pw_gid
    groups = os.getgrouplist(user, gid)
    env = {"HOME": entry.pw_dir, "USER": user, "LOGNAME": user}
    return _Credentials(entry.pw_uid, gid, groups, env)


def supervise(name: str) -> int:
    """Run unit ``name`` until SIGTERM, restarting it as its unit says."""
    unit, instance = find_unit(name)
    env = dict(os.environ, **unit.environment())
    argv = unit.exec_start(instance=instance, env=env)
    creds = _credentials(unit)
    env.update(creds.env)
    kill_signal = signal.Signals[unit.value("Service", "KillSignal") or "SIGTERM"]
    restart = unit.value("Service", "Restart") or "no"
    restart_s = parse_seconds(unit.value("Service", "RestartSec"), DEFAULT_RESTART_S)
    interval = parse_seconds(
        unit.value("Unit", "StartLimitIntervalSec"), DEFAULT_START_LIMIT_INTERVAL_S
    )
    burst = int(unit.value("Unit", "StartLimitBurst") or DEFAULT_START_LIMIT_BURST)
    stopping = False

    def on_term(_signo: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    starts: list[float] = []
    while True:
        now = time.monotonic()
        starts = [t for t in starts if now - t < interval] + [now]
        if len(starts) > burst:
            print(f"lab.units: {name}: start request repeated too quickly, giving up", flush=True)
            return 1
        print(f"lab.units: {name}: starting {shlex.join(argv)}", flush=True)
        child = subprocess.Popen(
            argv,
            env=env,
            cwd=unit.value("Service", "WorkingDirectory") or "/",
            stdin=subprocess.DEVNULL,
            user=creds.user,
            group=creds.group,
            extra_groups=creds.extra_groups,
        )
        while child.poll() is None and not stopping:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=0.2)
        if stopping:
            return _stop_child(name, child, kill_signal, _stop_timeout(unit))
        code = child.returncode
        print(f"lab.units: {name}: exited with {code}", flush=True)
        if restart not in ("on-failure", "always") or (code == 0 and restart == "on-failure"):
            return 0
        deadline = time.monotonic() + restart_s
        while time.monotonic() < deadline and not stopping:
            time.sleep(0.05)  # RestartSec: the unit's own pause
        if stopping:
            return 0


def _stop_child(
    name: str, child: subprocess.Popen[bytes], kill_signal: signal.Signals, timeout: float
) -> int:
    child.send_signal(kill_signal)
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"lab.units: {name}: still running after {timeout:.0f} s, SIGKILL", flush=True)
        child.kill()
        child.wait()
    print(f"lab.units: {name}: stopped ({child.returncode})", flush=True)
    return 0


def systemctl(argv: list[str]) -> int:
    """``systemctl``'s commands for the lab's units; returns the exit status."""
    if not argv:
        print("usage: systemctl COMMAND [UNIT...]", file=sys.stderr)
        return 2
    command, rest = argv[0], [a for a in argv[1:] if not a.startswith("-")]
    try:
        if command == "daemon-reload":
            return 0
        if command == "start" or (command == "enable" and "--now" in argv):
            for name in rest:
                start(name)
        elif command == "enable":
            return 0
        elif command == "stop":
            for name in rest:
                stop(name)
        elif command == "restart":
            for name in rest:
                stop(name)
                start(name)
        elif command == "is-active":
            active = all(supervisor_pid(name) is not None for name in rest)
            print("active" if active else "inactive")
            return 0 if active else 3
        elif command == "status":
            for name in rest:
                state = "active" if supervisor_pid(name) is not None else "inactive"
                print(f"{name}: {state}")
                with contextlib.suppress(FileNotFoundError):
                    print("\n".join(log_path(name).read_text().splitlines()[-10:]))
        else:
            print(f"lab.units: systemctl {command} is not supported here", file=sys.stderr)
            return 2
    except (UnitError, KeyError, OSError) as exc:
        print(f"lab.units: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["_supervise"]:
        return supervise(args[1])
    return systemctl(args)


if __name__ == "__main__":
    sys.exit(main())
