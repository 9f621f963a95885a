"""protocol/modes: the Qpid arguments of a mode, both ways, and their checks."""

from __future__ import annotations

import pytest

from protocol.modes import (
    Mode,
    as_text,
    check_declare_args,
    declare_args,
    from_args_mode,
    limit_value,
)


@pytest.mark.parametrize("mode", list(Mode))
def test_declare_args_read_back_as_their_mode_whatever_the_fallback(mode: Mode) -> None:
    for fallback in Mode:
        assert from_args_mode(declare_args(mode), fallback)[0] is mode


@pytest.mark.parametrize("mode", list(Mode))
def test_declare_args_pass_the_local_check(mode: Mode) -> None:
    assert check_declare_args(declare_args(mode)) is None


def test_declare_args_hands_out_a_fresh_dict() -> None:
    args = declare_args(Mode.FULL)
    args["qpid.replicate"] = "none"
    assert declare_args(Mode.FULL) == {"qpid.replicate": "all", "qpid.queue_event_generation": 2}


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"qpid.replicate": "some"}, "qpid.replicate='some' is not one of all, configuration"),
        ({"qpid.queue_event_generation": 3}, "qpid.queue_event_generation=3 is not 1 or 2"),
        ({"qpid.queue_event_generation": True}, "is not 1 or 2"),
        ({"qpid.max_count": -1}, "qpid.max_count=-1 is not a non-negative integer"),
        ({"max_depth": "x"}, "max_depth='x'"),
        ({"qpid.max_size": 1.5}, "qpid.max_size=1.5"),
    ],
)
def test_check_declare_args_names_the_wrong_argument(args: dict[str, object], words: str) -> None:
    problem = check_declare_args(args)
    assert problem is not None
    assert words in problem


def test_check_declare_args_accepts_generation_and_limits_as_text() -> None:
    assert check_declare_args({"qpid.queue_event_generation": "2", "qpid.max_count": "10"}) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (5, 5),
        (0, 0),
        ("12", 12),
        (-1, None),
        (True, None),
        ("1.5", None),
        (None, None),
        ("¹", None),  # a digit to str.isdigit(), not to int()
    ],
)
def test_limit_value(value: object, expected: int | None) -> None:
    assert limit_value(value) == expected


def test_as_text() -> None:
    assert [as_text(v) for v in (True, False, 1, "x", b"y", 1.5)] == [
        "true",
        "false",
        "1",
        "x",
        "y",
        "1.5",
    ]
