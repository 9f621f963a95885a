"""deploy/systemd: the units pass ``systemd-analyze verify`` with no warning, their
offline security exposure stays low, their stop timeout covers the SIGTERM grace,
their command lines parse, and the sysusers.d and tmpfiles.d snippets make the user
and the directories the units expect.

PID 1 here is not systemd: ``verify`` and ``security --offline`` read unit files
only; the sysusers and tmpfiles snippets are applied to a temporary ``--root``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import build_parser
from gateway.commands._service import SHUTDOWN_GRACE_S
from lab.units import UnitFile, parse_seconds

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = ["drgate-broker@.service", "drgate-sidecar@.service"]
# What the interpreter may take to exit once the grace is over (TimeoutStopSec).
EXIT_MARGIN_S = 5.0
# systemd-analyze security's exposure scale is 0 (locked down) .. 10; below 3 is "OK".
MAX_EXPOSURE = 3.0


def require_systemd_tools() -> None:
    if shutil.which("systemd-analyze") is None:
        reason = "systemd-analyze is not installed (apt-get install systemd)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"the systemd unit checks must run in CI: {reason}")
        pytest.skip(reason)


def verify(unit_dir: Path, *names: str) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` on instances of ``names`` in ``unit_dir``,
    their ``/usr/bin/drgate`` replaced by this interpreter's (verify wants the
    binary to exist)."""
    for name in names:
        text = (unit_dir / name).read_text()
        (unit_dir / name).write_text(text.replace("/usr/bin/drgate", drgate_binary()))
    instances = [name.replace("@.", "@site.") for name in names]
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *instances],
        capture_output=True,
        text=True,
        cwd=unit_dir,
        check=False,
        timeout=60,
    )


def drgate_binary() -> str:
    found = Path(sys.executable).parent / "drgate"
    return str(found) if found.exists() else sys.executable


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    require_systemd_tools()
    for name in UNITS:
        shutil.copy(SYSTEMD / name, tmp_path / name)
    return tmp_path


def test_the_units_verify_without_a_warning(unit_dir: Path) -> None:
    done = verify(unit_dir, *UNITS)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "" and done.stdout.strip() == "", done.stderr


def test_a_mistyped_key_is_caught(unit_dir: Path) -> None:
    """verify exits 0 on an unknown key: the test above fails on any output."""
    unit = unit_dir / UNITS[0]
    unit.write_text(unit.read_text().replace("Restart=on-failure", "Restrat=on-failure"))
    done = verify(unit_dir, UNITS[0])
    assert "Unknown key 'Restrat'" in done.stderr


@pytest.mark.parametrize("name", UNITS)
def test_the_offline_security_exposure_is_low(unit_dir: Path, name: str) -> None:
    threshold = round(MAX_EXPOSURE * 10)  # --threshold counts tenths
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", f"--threshold={threshold}", name],
        capture_output=True,
        text=True,
        cwd=unit_dir,
        check=False,
        timeout=60,
    )
    overall = [line for line in done.stdout.splitlines() if "Overall exposure" in line]
    assert done.returncode == 0, f"{name}: {overall or done.stderr}"


@pytest.mark.parametrize("name", UNITS)
def test_the_unit_orders_after_corosync_and_stops_within_the_grace(name: str) -> None:
    unit = UnitFile.read(SYSTEMD / name)
    assert "corosync.service" in unit.words("Unit", "After")
    assert "corosync.service" in unit.words("Unit", "Wants")
    assert unit.value("Service", "Restart") == "on-failure"
    assert unit.value("Service", "User") == "drgate"
    stop = parse_seconds(unit.value("Service", "TimeoutStopSec"))
    assert stop == SHUTDOWN_GRACE_S + EXIT_MARGIN_S
    for key, expect in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "ReadWritePaths": "/var/lib/drgate",
    }.items():
        assert unit.value("Service", key) == expect, key
    families = set(unit.words("Service", "RestrictAddressFamilies"))
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    # corosync's IPC shares memory in /dev/shm: a private /dev would cut the bus.
    assert unit.value("Service", "PrivateDevices") is None


@pytest.mark.parametrize("name", UNITS)
def test_the_command_line_parses_with_the_real_cli(name: str) -> None:
    argv = UnitFile.read(SYSTEMD / name).exec_start(instance="sidecar")
    assert argv[0] == "/usr/bin/drgate"
    assert argv[-2:] == ["--config", "/etc/drgate/sidecar.yaml"]
    args = build_parser().parse_args(argv[1:])
    assert args.config == "/etc/drgate/sidecar.yaml"


def test_sysusers_and_tmpfiles_make_the_user_and_the_writable_directory(tmp_path: Path) -> None:
    require_systemd_tools()
    for tool, snippet, folder in [
        ("systemd-sysusers", "drgate.sysusers", "usr/lib/sysusers.d"),
        ("systemd-tmpfiles", "drgate.tmpfiles", "usr/lib/tmpfiles.d"),
    ]:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / "etc").mkdir(exist_ok=True)
        shutil.copy(SYSTEMD / snippet, tmp_path / folder / "drgate.conf")
        argv = [tool, f"--root={tmp_path}"]
        argv += ["--create"] if tool == "systemd-tmpfiles" else []
        done = subprocess.run(
            [*argv, "drgate.conf"], capture_output=True, text=True, check=False, timeout=60
        )
        assert done.returncode == 0, done.stderr
    passwd = (tmp_path / "etc/passwd").read_text().splitlines()
    users = {line.split(":")[0]: line.split(":") for line in passwd}
    uid = int(users["drgate"][2])
    state = (tmp_path / "var/lib/drgate").stat()
    assert (state.st_uid, state.st_mode & 0o777) == (uid, 0o750)
    config = (tmp_path / "etc/drgate").stat()
    assert (config.st_uid, config.st_mode & 0o777) == (0, 0o750)


def test_the_labs_systemctl_reads_exec_start_as_systemd_does(tmp_path: Path) -> None:
    """lab/units.py, the walkthrough's systemctl: ``%i``, ``$VAR`` alone (split
    into words) and inside a word, EnvironmentFile with ``-``, time spans."""
    env_file = tmp_path / "env"
    env_file.write_text('# options\nOPTIONS="-a -b"\n')
    unit_path = tmp_path / "x@.service"
    unit_path.write_text(
        "[Service]\n"
        f"EnvironmentFile=-{tmp_path / 'missing'}\n"
        f"EnvironmentFile={env_file}\n"
        'Environment="DIR=/var/lib/x" ONE=1\n'
        "ExecStart=/usr/bin/x --config /etc/x/%i.yaml $OPTIONS --dir=${DIR}/%i $NONE\n"
        "TimeoutStopSec=1min 30s\n"
    )
    unit = UnitFile.read(unit_path)
    argv = unit.exec_start(instance="a", env=unit.environment())
    assert argv == ["/usr/bin/x", "--config", "/etc/x/a.yaml", "-a", "-b", "--dir=/var/lib/x/a"]
    assert parse_seconds(unit.value("Service", "TimeoutStopSec")) == 90.0
    assert parse_seconds("500ms") == 0.5
    assert unit.value("Service", "Restart") is None
