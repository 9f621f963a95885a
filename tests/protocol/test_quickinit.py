"""protocol/quickinit: a frozen dataclass built by quick_init's __init__ is
the one its own __init__ builds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.state import effects
from protocol import cluster as pc
from protocol.quickinit import quick_init


@dataclass(frozen=True, slots=True)
class Plain:
    name: str
    count: int = 1
    tags: dict[str, int] = field(default_factory=dict)


@quick_init
@dataclass(frozen=True, slots=True)
class Quick:
    name: str
    count: int = 1
    tags: dict[str, int] = field(default_factory=dict)


@given(st.text(), st.integers(), st.dictionaries(st.text(), st.integers()))
def test_the_same_fields_from_the_same_arguments(
    name: str, count: int, tags: dict[str, int]
) -> None:
    for args, kwargs in [
        ((name,), {}),
        ((name, count), {}),
        ((name,), {"tags": tags}),
        ((), {"name": name, "count": count, "tags": tags}),
    ]:
        assert dataclasses.astuple(Quick(*args, **kwargs)) == dataclasses.astuple(
            Plain(*args, **kwargs)
        )


def test_it_stays_frozen_and_each_default_factory_runs_again() -> None:
    one, two = Quick("a"), Quick("b")
    assert one.tags == {} and one.tags is not two.tags
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.name = "c"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Quick()  # type: ignore[call-arg]
    assert Quick("a", 2) == Quick("a", 2) and hash(Quick("a", 2, ())) == hash(Quick("a", 2, ()))


def test_classes_it_cannot_speed_up_are_refused() -> None:
    @dataclass(frozen=True, slots=True)
    class After:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclass(slots=True)
    class Mutable:
        x: int

    for cls in (After, Mutable):
        with pytest.raises(TypeError, match=cls.__name__):
            quick_init(cls)


def test_the_commands_and_the_per_message_effects_use_it() -> None:
    for cls in (pc.Publish, pc.Replicated, pc.Accept, effects.Message, effects.Delivered):
        assert cls.__init__.__module__ == cls.__module__
        assert "__setattr__" not in cls.__init__.__code__.co_names
