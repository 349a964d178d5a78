"""Every hand-written mutant (``python -m tests.mutants``) still applies to the code as
it stands: its old text occurs exactly once in its file. A change to a script or to
the engine that moves a mutant's text fails here, not in the next mutation run."""

from __future__ import annotations

import pytest

from tests.mutants import ENGINE_MUTANTS, LUA, MUTANTS, SRC, Mutant


@pytest.mark.parametrize("mutant", MUTANTS + ENGINE_MUTANTS, ids=lambda mutant: mutant.name)
def test_each_mutant_applies_to_exactly_one_place(mutant: Mutant) -> None:
    path = (SRC / "anarchon" if mutant.engine else LUA) / mutant.file
    assert path.read_text(encoding="utf-8").count(mutant.old) == 1, path
    assert mutant.new != mutant.old
