"""A real Prometheus (Debian's ``/usr/bin/prometheus``) scrapes a running
two-site lab with deploy/prometheus/prometheus.yml and alerts.yml.

The shipped files are rendered into a temp copy: the targets become the
lab's sidecars (the lab's brokers serve no /metrics, so the broker job is
left out), the scrape and evaluation intervals are 1 s, and every alert's
``for:`` is 2 s, so that the run takes seconds rather than minutes; the
expressions, labels and rule files are the shipped ones.  Through
Prometheus' HTTP API the test waits until every target is up, checks that
every alert rule evaluates (health ``ok``), then kills P's active egress
sidecar and waits for ``DrgateTargetDown`` on it to fire, and for it to
resolve once the sidecar is back (on the same port).
(``DrgateNoActiveEgress`` names ``site="site-p"`` in its expression; it
does not fire here, since another P sidecar takes over the egress.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab.site import ROOT, TwoSites, free_port
from tests.lab import status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
FOR = "2s"
DEADLINE_S = 45.0


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    path = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(path).exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("prometheus is missing; CI installs Debian's prometheus package")
        pytest.skip("Debian's prometheus package is not installed")
    return path


def render(two: TwoSites, folder: Path) -> Path:
    """prometheus.yml and alerts.yml for the lab in ``folder`` (see the module doc)."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    sidecars = jobs["drgate-sidecar"]
    sidecars["static_configs"] = [
        {
            "targets": [f"127.0.0.1:{two.metrics_port[(site.cluster, n)]}"],
            "labels": {"site": site.cluster, "node": str(n), "process": "sidecar"},
        }
        for site in (two.p, two.d)
        for n in two.nodes
    ]
    config["scrape_configs"] = [sidecars]
    alerts = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text(encoding="utf-8"))
    for group in alerts["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = FOR
    (folder / "alerts.yml").write_text(yaml.safe_dump(alerts), encoding="utf-8")
    assert config["rule_files"] == ["alerts.yml"]
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


class Prometheus:
    def __init__(self, binary: str, config: Path, folder: Path) -> None:
        self.port = free_port()
        self.log = (folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            document = json.load(reply)
        assert document["status"] == "success", document
        return document["data"]

    def answers(self) -> bool:
        assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
        try:
            self.api("status/buildinfo")
        except OSError:
            return False
        return True

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoSites]:
    with TwoSites(metrics=True, workdir=tmp_path_factory.mktemp("two")) as two:
        yield two


def alerts(prometheus: Prometheus, name: str, state: str) -> list[dict[str, str]]:
    return [
        a["labels"]
        for a in prometheus.api("alerts")["alerts"]
        if a["labels"]["alertname"] == name and a["state"] == state
    ]


def test_prometheus_scrapes_the_lab_and_the_alerts_fire_and_resolve(
    lab: TwoSites, prometheus_binary: str, tmp_path: Path
) -> None:
    prometheus = Prometheus(prometheus_binary, render(lab, tmp_path), tmp_path)
    try:
        wait_for("prometheus answers", prometheus.answers, timeout=DEADLINE_S)

        def all_up() -> bool:
            targets = prometheus.api("targets")["activeTargets"]
            return len(targets) == 2 * len(lab.nodes) and all(t["health"] == "up" for t in targets)

        wait_for("every sidecar target is up", all_up, timeout=DEADLINE_S)

        def rules() -> list[dict[str, Any]]:
            return [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]

        shipped = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text(encoding="utf-8"))
        names = {r["alert"] for g in shipped["groups"] for r in g["rules"]}
        wait_for(
            "every alert rule evaluated",
            lambda: all(r["health"] == "ok" for r in rules()),
            timeout=DEADLINE_S,
        )
        assert {r["name"] for r in rules()} == names
        assert [r for r in rules() if r["health"] != "ok"] == []
        assert alerts(prometheus, "DrgateTargetDown", "firing") == []

        egress = next(n for n in lab.nodes if status(lab, "site-p", n).get("role") == "egress")
        lab.p.kill(f"sidecar-{egress}")
        down = {"site": "site-p", "node": str(egress), "process": "sidecar"}

        def fired() -> bool:
            return any(
                down.items() <= labels.items()
                for labels in alerts(prometheus, "DrgateTargetDown", "firing")
            )

        wait_for(f"DrgateTargetDown fires for P's egress (node {egress})", fired)
        lab.start_sidecar(lab.p, egress)
        wait_for(
            "DrgateTargetDown resolves once the sidecar is back",
            lambda: (
                not alerts(prometheus, "DrgateTargetDown", "firing")
                and not alerts(prometheus, "DrgateTargetDown", "pending")
            ),
            timeout=DEADLINE_S,
        )
        assert alerts(prometheus, "DrgateNoActiveEgress", "firing") == []
    finally:
        prometheus.stop()
