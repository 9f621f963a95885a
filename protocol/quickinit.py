"""Frozen dataclasses that are quick to build.

A frozen dataclass's generated ``__init__`` stores each field with
``object.__setattr__(self, name, value)``, which CPython 3.11 makes check that
it is not bypassing a subclass's ``__setattr__``: on this machine about 0.17 µs
a field, four to seven times a plain store.  Every member of a site builds
several such objects per message (each decoded bus command, the state's
``Message`` and effects, the tap's event), so :func:`quick_init` gives a
class an ``__init__`` that stores each field through its slot's descriptor
instead: the same signature, defaults and default factories, the class
still frozen (assignment after construction still raises), equality, hash
and repr untouched.  The generated source is the dataclass's own, with one
store per line; ``inspect.getsource`` cannot show it, the class body is the
documentation.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar

__all__ = ["quick_init"]

_T = TypeVar("_T", bound=type)


def quick_init(cls: _T) -> _T:
    """Give the frozen, slotted dataclass ``cls`` a quicker ``__init__``.

    Put it above ``@dataclass(frozen=True, slots=True)``.  Raises
    :class:`TypeError` for a class this cannot speed up without changing
    what its ``__init__`` does (not a frozen slotted dataclass, a
    ``__post_init__``, a field left out of ``__init__`` or keyword-only)."""
    if not is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__}: quick_init takes a frozen dataclass")
    if "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: quick_init takes a dataclass with slots=True")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: quick_init does not run __post_init__")
    params: list[str] = []
    stores: list[str] = []
    env: dict[str, Any] = {"_MISSING": MISSING}
    for f in fields(cls):
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name}: quick_init takes positional init fields")
        env[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        if f.default is not MISSING:
            env[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
            stores.append(f"_set_{f.name}(self, {f.name})")
        elif f.default_factory is not MISSING:
            env[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            stores.append(
                f"_set_{f.name}(self, _factory_{f.name}() if {f.name} is _MISSING else {f.name})"
            )
        else:
            params.append(f.name)
            stores.append(f"_set_{f.name}(self, {f.name})")
    source = f"def __init__(self, {', '.join(params)}):\n    " + "\n    ".join(stores or ["pass"])
    namespace: dict[str, Any] = {}
    exec(source, env, namespace)  # names: the class's own fields
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
