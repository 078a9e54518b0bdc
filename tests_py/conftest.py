"""Pytest configuration shared by the Python test-suite."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# Property tests: enough examples to find edge cases, no wall-clock deadlines
# (CI machines are slow and shared).
settings.register_profile(
    "lmcache_rc",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("lmcache_rc")
