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
