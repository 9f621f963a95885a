"""Network addresses named in config: ``HOST:PORT`` parsed once into an :class:`Address`.

Every listen, peer, sequencer and metrics address of a broker or sidecar
config is parsed here, when the config is loaded; the code that binds or
connects takes the typed value and never splits a string again.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ConfigError, Location, Problem

MAX_PORT = 65535
# Where a value given as a command-line option is, for the error message.
COMMAND_LINE = Location("command line", 1, 1)


@dataclass(frozen=True, slots=True)
class Address:
    """A host (name, IPv4 or IPv6 literal, without brackets) and a TCP port.

    Port 0 is valid: a listener bound to it picks a free port.
    ``str()`` gives ``HOST:PORT``, with an IPv6 host in brackets, which
    :func:`parse_address` reads back.
    """

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_address(text: str, *, key: str, location: Location = COMMAND_LINE) -> Address:
    """``HOST:PORT`` (``[IPV6]:PORT`` for an IPv6 host) as an :class:`Address`.

    Raises :class:`ConfigError` at ``location`` (a config file's line, or
    the command line) naming ``key`` (how the value is named to a person,
    e.g. ``'amqp.listen'`` or ``--listen``), the value given and an example
    of the fix.
    """
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    valid = (
        sep
        and host
        and "[" not in host
        and "]" not in host
        and port.isdigit()
        and int(port) <= MAX_PORT
    )
    if not valid:
        raise ConfigError(
            [
                Problem(
                    location,
                    f"{key} must be HOST:PORT, got {text!r}",
                    "for example 127.0.0.1:5672, or [::1]:5672 for an IPv6 host",
                )
            ]
        )
    return Address(host, int(port))
