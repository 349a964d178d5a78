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

from tests.servers import ServerSpec, newest_of_family

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


def examples(in_ci: int, server: ServerSpec | None = None) -> int:
    """A test's own number of examples under ``ci`` (and ``mutants``), or a quarter of
    it on a ``server`` that is not the newest of its family (the older servers of CI's
    matrix: the scripts' replies there, at a quarter of the cost; the full count runs on
    the newest Valkey and Redis, which the quick run and the mutants use too); the
    profile's own number under ``deep``."""
    if PROFILE == "deep":
        return settings.default.max_examples
    if server is not None and not newest_of_family(server):
        return max(1, in_ci // 4)
    return in_ci
