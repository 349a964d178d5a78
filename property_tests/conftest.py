"""Loads the Hypothesis profile (property_tests/profiles.py) before any test."""

from __future__ import annotations

import property_tests.profiles  # noqa: F401
