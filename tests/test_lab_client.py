"""lab/client.py: a client whose broker goes away mid-connection reports and
exits, rather than retrying a dead address forever (found by tests/chaos: a
consumer on a killed broker hung the run)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def one_shot_listener() -> tuple[socket.socket, threading.Thread]:
    """A port that accepts one connection, reads a little and drops it, then
    stops listening: a broker killed after the client connected."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        conn.recv(64)
        conn.close()
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


@pytest.mark.parametrize(
    "args",
    [
        ["consume", "--idle", "1"],
        ["publish"],
        ["publish", "--rate", "10", "--count", "100"],  # its pacing timer kept it alive
    ],
    ids=["consume", "publish", "paced-publish"],
)
def test_a_client_whose_broker_goes_away_exits_with_the_error(args: list[str]) -> None:
    server, thread = one_shot_listener()
    url = f"amqp://127.0.0.1:{server.getsockname()[1]}"
    done = subprocess.run(
        [sys.executable, "-m", "lab.client", args[0], url, "q", *args[1:]],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
    thread.join(timeout=5)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"], result
    assert done.returncode == 2
