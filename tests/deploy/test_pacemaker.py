"""The Pacemaker OCF agent (deploy/pacemaker/drgate), its actions run directly.

Pacemaker itself does not run: the agent is a shell script whose contract is
its exit codes, so the tests call it as Pacemaker would (action as argument,
parameters as ``OCF_RESKEY_*``) against a live two-site lab.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.site import ROOT, TwoSites, finish_client

AGENT = ROOT / "deploy" / "pacemaker" / "drgate"
OCF_SUCCESS, OCF_ERR_GENERIC, OCF_ERR_CONFIGURED = 0, 1, 6
OCF_NOT_RUNNING, OCF_RUNNING_PROMOTED = 7, 8


def agent(action: str, state: Path, **params: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        DRGATE_PYTHON=sys.executable,
        OCF_RESOURCE_INSTANCE="drgate",
        OCF_RESKEY_drgate=f"{sys.executable} -m gateway.cli",
        OCF_RESKEY_state_dir=str(state),
        OCF_RESKEY_CRM_meta_timeout="30000",
        **{f"OCF_RESKEY_{k}": v for k, v in params.items()},
    )
    return subprocess.run(
        ["sh", str(AGENT), action],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )


def test_meta_data_and_validation(tmp_path: Path) -> None:
    meta = agent("meta-data", tmp_path)
    assert meta.returncode == OCF_SUCCESS
    for action in ("start", "stop", "monitor", "promote", "demote", "validate-all"):
        assert f'<action name="{action}"' in meta.stdout
    missing = agent("validate-all", tmp_path, config=str(tmp_path / "nope.yaml"))
    assert missing.returncode == OCF_ERR_CONFIGURED
    assert "nope.yaml" in missing.stderr
    config = tmp_path / "sidecar.yaml"
    config.write_text("site: x\n")
    assert agent("validate-all", tmp_path, config=str(config)).returncode == OCF_SUCCESS
    assert agent("monitor", tmp_path, config=str(config)).returncode == OCF_NOT_RUNNING
    assert agent("bogus", tmp_path).returncode == 3


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.slow
def test_actions_against_a_live_dr_site(tmp_path: Path) -> None:
    with TwoSites(workdir=tmp_path / "lab", metrics=True) as two:
        done = two.p.admin(1, "add-queue", "q-full", "--replicate", "full")
        assert done.returncode == 0, done.stderr
        popen = two.p.client_popen(1, "publish", two.p.amqp[1], "q-full", "--count", "50")
        assert finish_client(popen)["accepted"] == 50

        def params(node: int) -> dict[str, str]:
            port = two.metrics_port[("site-d", node)]
            return {
                "config": str(two.d.workdir / f"sidecar-{node}.yaml"),
                "status_url": f"http://127.0.0.1:{port}/status",
            }

        one, two_state = tmp_path / "node1", tmp_path / "node2"
        assert agent("monitor", one, **params(1)).returncode == OCF_NOT_RUNNING
        assert agent("start", one, **params(1)).returncode == OCF_SUCCESS
        assert agent("start", two_state, **params(2)).returncode == OCF_SUCCESS
        assert agent("monitor", one, **params(1)).returncode == OCF_SUCCESS
        assert agent("demote", one, **params(1)).returncode == OCF_SUCCESS  # nothing to do

        promoted = agent("promote", one, **params(1))
        assert promoted.returncode == OCF_SUCCESS, promoted.stderr
        assert agent("monitor", one, **params(1)).returncode == OCF_RUNNING_PROMOTED
        # The other instance runs unpromoted in a promoted site.
        assert agent("monitor", two_state, **params(2)).returncode == OCF_SUCCESS
        assert agent("promote", one, **params(1)).returncode == OCF_SUCCESS  # idempotent
        refused = agent("demote", one, **params(1))
        assert refused.returncode == OCF_ERR_GENERIC
        assert "re-seed" in refused.stderr

        published = two.d.client(1, "publish", two.d.amqp[1], "q-full", "--count", "1")
        assert published["accepted"] == 1, published

        assert agent("stop", one, **params(1)).returncode == OCF_SUCCESS
        assert agent("monitor", one, **params(1)).returncode == OCF_NOT_RUNNING
        # A sidecar that does not answer: a failure, not "not running".
        two.d.kill("sidecar-2")
        assert agent("monitor", two_state, **params(2)).returncode == OCF_ERR_GENERIC
