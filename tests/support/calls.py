"""Counting the calls of a method in a test (how often a hot path does a thing)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[None]:
    """Wrap ``owner.name`` (a function or method, plain or async) so that
    every call appends to the list returned; undone with ``monkeypatch``."""
    calls: list[None] = []
    real = getattr(owner, name)

    if inspect.iscoroutinefunction(real):

        async def counting_async(*args: Any, **kw: Any) -> Any:
            calls.append(None)
            return await real(*args, **kw)

        monkeypatch.setattr(owner, name, counting_async)
    else:

        def counting(*args: Any, **kw: Any) -> Any:
            calls.append(None)
            return real(*args, **kw)

        monkeypatch.setattr(owner, name, counting)
    return calls
