"""Hypothesis profiles, picked by ``HYPOTHESIS_PROFILE``:

- ``ci`` (the default): each test's own number of examples (``examples(n)`` in its
  file), sized so that the whole suite fits CI's budget and still kills every Lua
  mutant (``python -m tests.mutants`` runs the mutants under these same counts);
- ``deep``: 20,000 examples of up to 100 steps per test (the engine machine 200 of up
  to 60), a soak of hours (``long`` is its former name and still works);
- ``mutants``: ``ci``'s counts with no shrinking and no example database, for
  ``python -m tests.mutants`` (which also fixes the seed): a kill needs one failing
  example, and a mutant's failures must not be replayed by the next ordinary run.

Failures print a reproducible example.
"""

from __future__ import annotations

import os

from hypothesis import Phase, settings

_ASKED = os.environ.get("HYPOTHESIS_PROFILE", "ci")
PROFILE = "deep" if _ASKED == "long" else _ASKED

settings.register_profile("ci", max_examples=150, stateful_step_count=40, deadline=None)
settings.register_profile("deep", max_examples=20_000, stateful_step_count=100, deadline=None)
settings.register_profile(
    "mutants",
    settings.get_profile("ci"),
    database=None,
    phases=(Phase.explicit, Phase.generate),
)
settings.load_profile(PROFILE)


def examples(in_ci: int) -> int:
    """A test's own number of examples under ``ci`` (and ``mutants``); the profile's
    under ``deep``."""
    return settings.default.max_examples if PROFILE == "deep" else in_ci
