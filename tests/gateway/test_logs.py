"""gateway.logs: one structured line per event, key=value or JSON."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from gateway.logs import configure_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


def kv_pairs(line: str) -> dict[str, str]:
    """Parse one key=value line (values may be JSON-quoted strings)."""
    out = {}
    rest = line
    while rest:
        key, _, rest = rest.partition("=")
        if rest.startswith('"'):
            decoder = json.JSONDecoder()
            value, end = decoder.raw_decode(rest)
            rest = rest[end:].lstrip(" ")
        else:
            value, _, rest = rest.partition(" ")
        out[key] = value
    return out


@pytest.mark.usefixtures("restore_root")
def test_kv_lines_carry_site_node_role_and_cseq() -> None:
    role = ["standby"]
    out = io.StringIO()
    configure_logging("kv", "info", site="site-p", node=2, role_getter=lambda: role[0], stream=out)
    log = logging.getLogger("drgate.test")
    log.info("view changed", extra={"cseq": 41, "members": 3})
    role[0] = "egress"
    log.warning('link refused: "stale epoch" = 3', extra={"cseq": 42, "peer": "d1:7000"})
    log.debug("not shown")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = kv_pairs(lines[0]), kv_pairs(lines[1])
    assert list(first)[:7] == ["ts", "level", "logger", "site", "node", "role", "msg"]
    assert first["ts"].endswith("Z")
    assert len(first["ts"]) == len("2024-01-01T00:00:00.000Z")
    assert (first["level"], first["logger"]) == ("info", "drgate.test")
    assert (first["site"], first["node"], first["role"]) == ("site-p", "2", "standby")
    assert (first["msg"], first["cseq"], first["members"]) == ("view changed", "41", "3")
    assert second["role"] == "egress"
    assert second["level"] == "warning"
    assert second["msg"] == 'link refused: "stale epoch" = 3'
    assert second["peer"] == "d1:7000"
    assert second["cseq"] == "42"


@pytest.mark.usefixtures("restore_root")
def test_json_lines_and_exceptions_stay_on_one_line() -> None:
    out = io.StringIO()
    configure_logging("json", logging.DEBUG, site="site-d", node=1, stream=out)
    log = logging.getLogger("drgate.test")
    log.debug("plain")
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        log.exception("spool corrupt", extra={"cseq": 7, "path": "/var/spool/x"})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    plain, failed = json.loads(lines[0]), json.loads(lines[1])
    assert plain["site"] == "site-d"
    assert plain["node"] == 1
    assert plain["role"] == "starting"
    assert plain["msg"] == "plain"
    assert "cseq" not in plain
    assert failed["cseq"] == 7
    assert failed["path"] == "/var/spool/x"
    assert failed["level"] == "error"
    assert "ValueError: bad" in failed["exc"]


@pytest.mark.usefixtures("restore_root")
def test_kv_exception_is_escaped_onto_the_same_line() -> None:
    out = io.StringIO()
    configure_logging("kv", "info", site="s", node=1, stream=out)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("x").exception("failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert "RuntimeError: boom" in kv_pairs(lines[0])["exc"]


@pytest.mark.usefixtures("restore_root")
def test_reconfiguring_replaces_the_handler_and_a_broken_role_getter_is_survived() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("kv", "info", site="a", node=1, stream=first)

    def broken() -> str:
        raise RuntimeError("no role yet")

    configure_logging("kv", "info", site="a", node=1, role_getter=broken, stream=second)
    logging.getLogger("x").info("once")
    assert first.getvalue() == ""
    assert kv_pairs(second.getvalue().strip())["role"] == "?"


def test_unknown_format_or_level_is_refused() -> None:
    with pytest.raises(ValueError, match="kv, json"):
        configure_logging("xml")
    with pytest.raises(ValueError, match="log level"):
        configure_logging("kv", "loud")
