"""gateway/peerswatch: a primary sidecar takes an edited ``peers`` list at
run time; a config edited into something invalid changes nothing and says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import load_sidecar_config
from gateway.peerswatch import PeersWatcher
from tests.gateway.test_config import sidecar
from tests.lab import replace_file

TWO = "peers: [10.0.1.1:7500, 10.0.1.2:7500]"
THREE = "peers: [10.0.1.1:7500, 10.0.1.2:7500, 10.0.1.3:7500]"


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "sidecar.yaml"
    path.write_text(sidecar())
    return path


def test_an_added_d_sidecar_is_taken_at_the_next_poll(config_path: Path) -> None:
    config = load_sidecar_config(str(config_path))
    watcher = PeersWatcher(config)
    watcher.start_from()
    assert watcher.poll(config.peers) is None  # unchanged
    replace_file(config_path, sidecar().replace(TWO, THREE))
    peers = watcher.poll(config.peers)
    assert peers is not None
    assert [str(p) for p in peers] == ["10.0.1.1:7500", "10.0.1.2:7500", "10.0.1.3:7500"]
    assert watcher.poll(peers) is None  # seen once


def test_an_invalid_edit_keeps_the_peers_and_says_why_until_fixed(config_path: Path) -> None:
    config = load_sidecar_config(str(config_path))
    watcher = PeersWatcher(config)
    watcher.start_from()
    replace_file(config_path, sidecar().replace(TWO, "peers: [10.0.1.1:none]"))
    assert watcher.poll(config.peers) is None
    assert str(config_path) in watcher.problem
    assert "10.0.1.1:7500, 10.0.1.2:7500" in watcher.problem  # what stays in use
    replace_file(config_path, sidecar().replace(TWO, THREE))
    assert watcher.poll(config.peers) is not None
    assert watcher.problem == ""


def test_a_config_edited_back_to_the_peers_in_use_changes_nothing(config_path: Path) -> None:
    config = load_sidecar_config(str(config_path))
    watcher = PeersWatcher(config)
    watcher.start_from()
    replace_file(config_path, sidecar().replace("fsync: always", "fsync: never"))
    assert watcher.poll(config.peers) is None  # only a setting for the next start
