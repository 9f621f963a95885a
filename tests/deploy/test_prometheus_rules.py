"""deploy/prometheus and deploy/grafana: promtool checks the rules and runs their unit
tests, and every metric the rules and the dashboard use is one that gateway.metrics
exports (so a renamed metric cannot silently blind an alert)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cluster.state.model import COUNTERS
from gateway.metrics import build_registry, render_metrics
from tests.support.statistics import full_snapshot

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "drgate.json"
METRIC = re.compile(r"\bdrgate_[a-z0-9_]+\b")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("promtool is missing; CI installs Debian's prometheus package (make deb)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return path


def run_promtool(promtool: str, *args: str) -> str:
    result = subprocess.run(
        [promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_promtool_check_rules(promtool: str) -> None:
    output = run_promtool(promtool, "check", "rules", "alerts.yml")
    assert "SUCCESS" in output


def test_promtool_test_rules(promtool: str) -> None:
    output = run_promtool(promtool, "test", "rules", "alerts_test.yml")
    assert "SUCCESS" in output


def test_promtool_check_config(promtool: str) -> None:
    output = run_promtool(promtool, "check", "config", "prometheus.yml")
    assert "SUCCESS" in output


def alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    doc = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())
    firing, quiet = set(), set()
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert names >= {
        "DrgateLagHigh",
        "DrgateLinkDown",
        "DrgateSpoolNearlyFull",
        "DrgateResyncNeeded",
        "DrgateConflictsRising",
        "DrgateNoActiveEgress",
        "DrgateRecoveryPointStale",
        "DrgateResyncStalled",
        "DrgatePartitioned",
    }
    assert names - firing == set(), "alerts never shown firing"
    assert names - quiet == set(), "alerts never shown quiet"


def test_no_alert_names_a_site() -> None:
    """A promotion (or a switchover) changes which site is the primary: a rule
    that names one would watch the wrong site afterwards."""
    for rule in alerts():
        assert not re.search(r"\bsite\s*=~?\s*\"", rule["expr"]), rule["alert"]


def test_scrape_config_covers_both_sites_sidecars_and_brokers() -> None:
    doc = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    seen = set()
    for job in doc["scrape_configs"]:
        assert job["honor_labels"] is True  # the exported site/node/process win
        for static in job["static_configs"]:
            labels = static["labels"]
            seen.add((labels["site"], labels["process"]))
    assert seen == {(s, p) for s in ("site-p", "site-d") for p in ("sidecar", "broker")}


def exported_names() -> set[str]:
    """Every metric name a sidecar exports, from a snapshot with every field set."""
    snapshot = replace(full_snapshot(), merge=dict.fromkeys(COUNTERS, 1))
    text = render_metrics(build_registry(lambda: snapshot, process=False)).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_alert_rules_use_only_exported_metrics() -> None:
    used = set()
    for rule in alerts():
        used |= set(METRIC.findall(rule["expr"]))
    assert used
    assert used - exported_names() == set()


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    return exprs


def test_dashboard_uses_only_exported_metrics_and_has_the_panels() -> None:
    doc = json.loads(DASHBOARD.read_text())
    titles = " ".join(p["title"].lower() for p in doc["panels"])
    for word in ("lag", "link", "forwarded", "spool", "conflicts", "rtt", "role"):
        assert word in titles, word
    for words in ("recovery point at d", "split brain", "active egresses", "resync progress"):
        assert words in titles, words
    used = {name for expr in dashboard_exprs() for name in METRIC.findall(expr)}
    assert {"drgate_lag_seconds", "drgate_lag_events", "drgate_link_rtt_seconds"} <= used
    assert {"drgate_rpo_seconds", "drgate_rpo_events", "drgate_partitioned"} <= used
    assert used - exported_names() == set()
    assert doc["uid"] == "drgate"
