"""lab.netns without root: the corosync.conf and authkey it writes (the site itself is in
the corosync suite, e.g. tests/cluster/bus/test_contract.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lab.netns import AUTHKEY_BYTES, CorosyncSite, LabError, LabNode
from tests.lab import require_corosync


def test_every_node_encrypts_the_ring_with_the_sites_authkey(tmp_path: Path) -> None:
    site = CorosyncSite("siteA", nodes=3, workdir=tmp_path / "siteA")
    key = site.ensure_authkey()
    assert key == tmp_path / "siteA" / "authkey"
    assert stat.S_IMODE(key.stat().st_mode) == 0o400
    secret = key.read_bytes()
    assert len(secret) == AUTHKEY_BYTES
    assert site.ensure_authkey().read_bytes() == secret  # kept, not replaced
    for node in site.nodes:
        totem = site.corosync_conf(node).split("totem {\n", 1)[1].split("}\n", 1)[0]
        lines = {line.strip() for line in totem.splitlines()}
        assert {"transport: knet", "crypto_cipher: aes256", "crypto_hash: sha256"} <= lines
        assert f"keyfile: {key}" in lines
    other = CorosyncSite("siteB", nodes=3, workdir=tmp_path / "siteB")
    assert other.ensure_authkey().read_bytes() != secret


def test_no_uidgid_entry_opens_a_nodes_groups_to_other_local_users(tmp_path: Path) -> None:
    """Corosync's IPC admits root and the users and groups of ``uidgid``
    entries to CPG groups; the lab runs everything as root and names no one
    else (docs/bus.md, "Who may join a site's bus")."""
    site = CorosyncSite("siteA", nodes=3, workdir=tmp_path / "siteA")
    for node in site.nodes:
        sections = [line.split("{")[0].strip() for line in site.corosync_conf(node).splitlines()]
        assert "uidgid" not in sections


@pytest.mark.corosync
@pytest.mark.integration
@pytest.mark.slow
def test_a_node_with_another_key_never_joins_the_ring() -> None:
    require_corosync()
    site = CorosyncSite("keyA", nodes=2, subnet="10.213.30", prefix="dgK")
    own_conf = site.corosync_conf
    stranger = site.workdir / "another-authkey"
    stranger.write_bytes(os.urandom(AUTHKEY_BYTES))

    def conf(node: LabNode) -> str:
        text = own_conf(node)
        return text.replace(str(site.authkey_path), str(stranger)) if node.nodeid == 2 else text

    site.corosync_conf = conf  # type: ignore[method-assign]
    try:
        with pytest.raises(LabError):
            site.up(timeout=6)
        assert site.members_seen_by(1) == (1, False)
        assert "Unable to decrypt packet" in site.node(1).log_path.read_text()
    finally:
        site.down()
