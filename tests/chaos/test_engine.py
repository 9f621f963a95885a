"""The chaos runner's client runs end on their own: a client still running
after ``CLIENT_HANG_S`` is reported stuck, so no run may last that long
while its broker serves it, however steady the flow."""

from __future__ import annotations

import pytest

from tests.chaos.engine import CLIENT_HANG_S, D_CONSUMED, P_CONSUMED, QUEUES, RATE, client_options


def _value(options: list[str], flag: str) -> float:
    assert flag in options, f"{flag} missing from {options}"
    return float(options[options.index(flag) + 1])


@pytest.mark.parametrize("queue", list(QUEUES))
def test_a_publishers_batch_ends_well_within_the_hang_limit(queue: str) -> None:
    options = client_options("publish", queue, at_p=True, start=1)
    assert _value(options, "--count") / _value(options, "--rate") < CLIENT_HANG_S / 2


@pytest.mark.parametrize(
    ("queue", "at_p"), [(q, True) for q in P_CONSUMED] + [(q, False) for q in D_CONSUMED]
)
def test_a_consumer_fed_without_pause_ends_by_its_count(queue: str, at_p: bool) -> None:
    # A consumer ends when idle or at its count.  Fed at its queue's offered
    # rate it is never idle (CI's fresh seed: a D consumer of q-enq received
    # 1,086 messages in 45 s and was killed as stuck), so its count must end it.
    options = client_options("consume", queue, at_p=at_p, start=1)
    assert _value(options, "--count") / RATE[queue] < CLIENT_HANG_S / 2
