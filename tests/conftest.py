"""Suite-wide settings."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# CI explores more examples; a developer's fast run stays fast.
settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
