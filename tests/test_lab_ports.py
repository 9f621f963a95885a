"""The lab's chosen ports: none an outgoing connection can take first."""

from __future__ import annotations

import socket

from lab.site import ephemeral_ports, free_port


def test_a_chosen_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    # CI failed a D sidecar on "Address already in use": its port, from
    # bind(0), was in the range the kernel hands outgoing connections, and
    # the WAN emulator redialling it while nothing listened could self-connect.
    ephemeral = ephemeral_ports()
    for _ in range(50):
        port = free_port()
        assert port not in ephemeral
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
