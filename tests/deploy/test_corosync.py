"""deploy/corosync: the shipped corosync.conf examples are what lab/corosyncconf.py
renders (the writer the namespace lab uses too), and their quorum settings do in a
real ring what their comments say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lab.corosyncconf import RingNode, quorum_section, render_corosync_conf
from lab.netns import CorosyncSite
from tests.lab import corosync_lab, wait_for

ROOT = Path(__file__).resolve().parents[2]
COROSYNC = ROOT / "deploy" / "corosync"
EXAMPLE_NODES = [RingNode(i, f"p{i}", f"10.0.0.{i}") for i in (1, 2, 3)]


def sections(text: str) -> dict[str, list[str]]:
    """Top-level section name -> its lines without comments (nested ones flattened)."""
    found: dict[str, list[str]] = {}
    current: str | None = None
    depth = 0
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("{"):
            if depth == 0:
                current = line[:-1].strip()
                found[current] = []
            depth += 1
        elif line == "}":
            depth -= 1
        elif current is not None:
            found[current].append(line)
    return found


@pytest.mark.parametrize(
    ("name", "count"), [("corosync-3node.conf", 3), ("corosync-2node.conf", 2)]
)
def test_the_shipped_examples_are_what_the_renderer_writes(name: str, count: int) -> None:
    shipped = (COROSYNC / name).read_text()
    assert shipped == render_corosync_conf("site-p", EXAMPLE_NODES[:count]), (
        f"deploy/corosync/{name} drifted from lab/corosyncconf.py: re-render it with "
        f"python3 -m lab.corosyncconf --cluster-name site-p "
        + " ".join(f"--node {n.name}={n.address}" for n in EXAMPLE_NODES[:count])
    )
    parsed = sections(shipped)
    totem = set(parsed["totem"])
    assert {"transport: knet", "crypto_cipher: aes256", "crypto_hash: sha256"} <= totem
    assert "keyfile: /etc/corosync/authkey" in totem
    assert parsed["uidgid"] == ["uid: drgate", "gid: drgate"]
    assert len([line for line in parsed["nodelist"] if line.startswith("nodeid:")]) == count


def test_a_two_node_site_breaks_ties_instead_of_two_node() -> None:
    quorum = sections(quorum_section(2))["quorum"]
    assert "auto_tie_breaker: 1" in quorum
    assert "wait_for_all: 1" in quorum
    assert not any(line.startswith("two_node") for line in quorum)
    assert sections(quorum_section(3))["quorum"] == [
        "provider: corosync_votequorum",
        "wait_for_all: 1",
    ]


def test_the_lab_renders_the_same_quorum_and_crypto(tmp_path: Path) -> None:
    for count in (2, 3):
        site = CorosyncSite("siteA", nodes=count, workdir=tmp_path / f"s{count}")
        conf = site.corosync_conf(site.node(1))
        assert quorum_section(count) in conf
        shipped = sections((COROSYNC / f"corosync-{count}node.conf").read_text())
        crypto = {line for line in shipped["totem"] if line.startswith("crypto_")}
        assert crypto <= set(sections(conf)["totem"])


def test_the_command_line_renders_and_names_a_bad_node() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "lab.corosyncconf", *args]
        return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=False)

    good = run("--cluster-name", "site-p", "--node", "p1=10.0.0.1", "--node", "p2=10.0.0.2")
    assert good.returncode == 0, good.stderr
    assert good.stdout == (COROSYNC / "corosync-2node.conf").read_text()
    bad = run("--cluster-name", "site-p", "--node", "10.0.0.1")
    assert bad.returncode == 2
    assert "--node '10.0.0.1': give NAME=ADDRESS" in bad.stderr


def quorum_seen(site: CorosyncSite, expect: dict[int, tuple[int, bool]]) -> None:
    wait_for(
        f"every node sees membership and quorum {expect}",
        lambda: {n: site.members_seen_by(n) for n in expect} == expect,
        timeout=20,
    )


@pytest.mark.corosync
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 3])
def test_the_template_runs_and_the_lowest_half_keeps_quorum(count: int) -> None:
    """The template rendered for the lab's ring: corosync accepts it (``-t``),
    the ring forms, and cutting the highest node leaves node 1's side quorate
    (a majority of 3; the tie breaker of 2) and the cut node not."""
    with corosync_lab(f"tmpl{count}", subnet="10.213.32", prefix="dgT", nodes=count) as site:
        checked = site.run_in(1, ["corosync", "-t", "-c", str(site.node(1).config_path)])
        assert checked.returncode == 0, checked.stdout + checked.stderr
        site.cut(count)
        rest = dict.fromkeys(range(1, count), (count - 1, True))
        quorum_seen(site, {**rest, count: (1, False)})
        site.restore(count)
        quorum_seen(site, dict.fromkeys(range(1, count + 1), (count, True)))
