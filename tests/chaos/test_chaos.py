"""The chaos suite in CI: a fixed-seed schedule of 30 overlapping faults on
two durable sites (embedded bus), then a fresh seed, printed, of the same
length.  A failure prints the seed, the timeline and the first divergent
message; ``make chaos SEED=<seed> FAULTS=30`` replays the schedule."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.chaos.engine import ChaosOptions, run_chaos

pytestmark = [pytest.mark.chaos, pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

FIXED_SEED = 2026  # with a switchover and its switch back, a restart-site, a full spool
CI_FAULTS = 30


def test_a_fixed_seed_schedule_of_30_faults_loses_nothing_and_applies_nothing_twice(
    tmp_path: Path,
) -> None:
    report = run_chaos(ChaosOptions(seed=FIXED_SEED, faults=CI_FAULTS, workdir=tmp_path))
    assert report.ok, report.text()
    assert report.accepted > 0


def test_a_fresh_seed_loses_nothing_and_applies_nothing_twice(tmp_path: Path) -> None:
    seed = random.SystemRandom().randrange(1 << 31)
    print(f"chaos: fresh seed {seed} (make chaos SEED={seed} FAULTS={CI_FAULTS} replays it)")
    report = run_chaos(ChaosOptions(seed=seed, faults=CI_FAULTS, workdir=tmp_path))
    assert report.ok, report.text()
