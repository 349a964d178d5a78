"""Loads the Hypothesis profile (property_tests/profiles.py) before any test, and gives
each property test a whole-test timeout of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

import property_tests.profiles  # noqa: F401

#: A property test runs hundreds of examples against a real server: the lease machine's
#: 1000 take about 2 minutes alone on a 2-core machine, and 2.5 times that when the
#: suite's other workers share the CPUs. The suite's 300 s is for a test that hangs;
#: a property test gets this much before it counts as hung.
PROPERTY_TEST_TIMEOUT_SEC = 1200

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.timeout(PROPERTY_TEST_TIMEOUT_SEC))
    items[:] = _spread(items)


def _spread(items: list[pytest.Item]) -> list[pytest.Item]:
    """The property tests spread evenly between the other modules' tests (never inside
    a module, whose module fixtures would be set up again). They keep the CPUs busy
    while the other tests mostly wait on slots and servers; collected last, they ran
    together at the end, four CPU-bound workers on two CPUs, for the last 11 minutes of
    the full matrix."""
    heavy = [item for item in items if _HERE in item.path.parents]
    rest = [item for item in items if _HERE not in item.path.parents]
    if not heavy or not rest:
        return items
    # Module ends, the last one left out (a property test there would be the tail again).
    ends = [k for k in range(1, len(rest)) if rest[k].path != rest[k - 1].path] or [len(rest)]
    spread: list[pytest.Item] = []
    start = 0
    for index, item in enumerate(heavy):
        # The module end nearest this test's even share of the others.
        share = (index + 0.5) * len(rest) / len(heavy)
        end = min(ends, key=lambda k: abs(k - share))
        spread += rest[start:end]
        start = max(start, end)
        spread.append(item)
    return spread + rest[start:]
