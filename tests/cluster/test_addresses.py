"""cluster.addresses: HOST:PORT parsed once, with a message that names the key and the fix."""

from __future__ import annotations

import pytest

from cluster.addresses import COMMAND_LINE, Address, parse_address
from protocol.errors import ConfigError, Location

HERE = Location("broker.yaml", 8, 11)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:5672", Address("127.0.0.1", 5672)),
        ("broker-1.example:0", Address("broker-1.example", 0)),
        ("0.0.0.0:65535", Address("0.0.0.0", 65535)),
        ("[::1]:5672", Address("::1", 5672)),
        ("[fe80::1%eth0]:7500", Address("fe80::1%eth0", 7500)),
    ],
)
def test_good_addresses_parse_and_print_back(text: str, expected: Address) -> None:
    address = parse_address(text, key="'amqp.listen'", location=HERE)
    assert address == expected
    assert str(address) == text
    assert parse_address(str(address), key="'amqp.listen'", location=HERE) == address


@pytest.mark.parametrize(
    "text",
    ["localhost", ":5672", "[]:5672", "host:", "host:http", "host:-1", "host:65536", "[::1:5672"],
)
def test_bad_addresses_name_the_key_the_place_and_the_fix(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_address(text, key="'amqp.listen'", location=HERE)
    (problem,) = caught.value.problems
    assert problem.location == HERE
    assert problem.message == f"'amqp.listen' must be HOST:PORT, got {text!r}"
    assert "[::1]:5672" in problem.hint


def test_a_command_line_value_is_placed_on_the_command_line() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_address("nope", key="--listen")
    assert caught.value.problems[0].location == COMMAND_LINE
    assert str(caught.value).startswith("command line:1:1: error: --listen must be HOST:PORT")


def test_addresses_are_frozen_values() -> None:
    address = Address("::1", 1)
    assert address == Address("::1", 1) and hash(address) == hash(Address("::1", 1))
    with pytest.raises(AttributeError):
        address.port = 2  # type: ignore[misc]
