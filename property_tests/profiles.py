"""Hypothesis profiles: ``ci`` (the default, the whole suite in minutes) and ``long``
(a soak: ``HYPOTHESIS_PROFILE=long``). Failures print a reproducible example."""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

settings.register_profile("ci", max_examples=150, stateful_step_count=40, deadline=None)
settings.register_profile("long", max_examples=20_000, stateful_step_count=100, deadline=None)
settings.load_profile(PROFILE)


def examples(in_ci: int) -> int:
    """A test's own number of examples under ``ci``; the profile's under any other."""
    return in_ci if PROFILE == "ci" else settings.default.max_examples
