"""How the sidecar reads a failed link: a refusal raised in a nursery's body
arrives wrapped in an exception group, and must still be seen as a refusal
(an operator-only fix such as a promotion), not as a retriable failure."""

from __future__ import annotations

import pytest
import trio

from gateway.linkconnect import describe_error, link_error_in
from protocol.errors import DrgateError, LinkError


async def _refused_in_a_nursery() -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)
        raise LinkError("site-d was promoted", code=7, retriable=False)


async def test_a_refusal_raised_in_a_nursery_is_found_inside_the_group() -> None:
    with pytest.raises(BaseExceptionGroup) as caught:
        await _refused_in_a_nursery()
    found = link_error_in(caught.value)
    assert found is not None and not found.retriable and found.code == 7
    assert describe_error(caught.value) == "site-d was promoted"


def test_other_failures_carry_no_link_error() -> None:
    assert link_error_in(DrgateError("closed the link")) is None
    assert link_error_in(ExceptionGroup("x", [OSError("reset")])) is None
    nested = ExceptionGroup("x", [ExceptionGroup("y", [LinkError("busy", retriable=True)])])
    found = link_error_in(nested)
    assert found is not None and found.retriable
