"""The sidecar config's ``link:`` section (gateway/linkconfig.py): defaults,
values, and the mistakes named with file:line:column and a fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import load_sidecar_config
from gateway.linkconfig import LinkSettings
from protocol.errors import ConfigError
from tests.gateway.test_config import problems_of, sidecar, write


def with_link(tmp_path: Path, link: str) -> Path:
    return write(tmp_path, "sidecar.yaml", sidecar() + f"link: {link}\n")


def test_the_defaults_are_the_link_machines_own() -> None:
    settings = LinkSettings()
    assert (settings.ack_events, settings.ack_ms) == (256, 20)
    assert settings.window_bytes == 8 * 1024 * 1024
    assert (settings.heartbeat_ms, settings.heartbeat_timeout_ms) == (5_000, 15_000)
    sender = settings.sender_config("p", "d", incarnation=1, epoch=1)
    receiver = settings.receiver_config("d")
    assert (sender.ping_interval, sender.heartbeat_timeout) == (5.0, 15.0)
    assert (settings.linger_ms, sender.linger) == (0, 0.0)
    assert (receiver.ack_every_events, receiver.ack_delay) == (256, 0.02)


def test_link_values_reach_both_ends(tmp_path: Path) -> None:
    path = with_link(
        tmp_path,
        "{ack_events: 50, ack_ms: 100, window_bytes: 1048576, heartbeat_ms: 1000, "
        "heartbeat_timeout_ms: 4000}",
    )
    config = load_sidecar_config(str(path))
    assert config.link == LinkSettings(50, 100, 1 << 20, 1_000, 4_000)
    sender = config.link.sender_config("p", "d", incarnation=1, epoch=1)
    assert (sender.window_bytes, sender.ping_interval, sender.heartbeat_timeout) == (
        1 << 20,
        1.0,
        4.0,
    )
    assert config.link.verify_s == 60  # the default
    assert load_sidecar_config(str(with_link(tmp_path, "{verify_s: 0}"))).link.verify_s == 0
    lingering = load_sidecar_config(str(with_link(tmp_path, "{linger_ms: 5}"))).link
    assert lingering.sender_config("p", "d", incarnation=1, epoch=1).linger == 0.005
    receiver = config.link.receiver_config("d")
    assert (receiver.ack_every_events, receiver.ack_delay, receiver.heartbeat_timeout) == (
        50,
        0.1,
        4.0,
    )


@pytest.mark.parametrize(
    ("link", "column", "words"),
    [
        ("{ack_event: 5}", 8, ["unknown key 'ack_event' in 'link'", "did you mean 'ack_events'"]),
        ("{ack_events: 0}", 20, ["'link.ack_events' must be at least 1, got 0"]),
        ("{ack_ms: 20ms}", 16, ["'link.ack_ms' must be an integer"]),
        ("{window_bytes: 1024}", 22, ["'link.window_bytes' must be at least 262144"]),
        (
            "{heartbeat_ms: 5000, heartbeat_timeout_ms: 5000}",
            50,
            ["must be more than 'link.heartbeat_ms' (5000)", "heartbeat_timeout_ms: 15000"],
        ),
        (
            "{heartbeat_ms: 20000}",
            22,
            ["'link.heartbeat_timeout_ms' (15000) must be more than"],
        ),
        ("{verify_s: -5}", 18, ["'link.verify_s' must be at least 0, got -5"]),
        ("{verify_s: 90000}", 18, ["'link.verify_s' must be at most 86400"]),
        ("{linger_ms: 2000}", 19, ["'link.linger_ms' must be at most 1000"]),
        ("{linger_ms: -1}", 19, ["'link.linger_ms' must be at least 0"]),
    ],
)
def test_bad_link_values_name_the_key_the_place_and_the_fix(
    tmp_path: Path, link: str, column: int, words: list[str]
) -> None:
    path = with_link(tmp_path, link)
    line = sidecar().count("\n") + 1
    with pytest.raises(ConfigError) as caught:
        load_sidecar_config(str(path))
    found = problems_of(caught.value)
    assert len(found) == 1, found
    assert found[0].startswith(f"{path}:{line}:{column}: error: "), found
    for word in words:
        assert word in found[0], found
