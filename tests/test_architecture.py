"""The layout's rules that a type checker does not hold, read from the code itself
(docs/contributing/architecture.md states them):

- no module imports an underscore name of another module;
- ``_timers.py`` imports nothing of the engine: it reaches a scheduler's instance
  through its ``TimerHost`` protocol;
- the engine asks nothing about which strategy it runs: no ``leases`` flag, no
  strategy's name compared, no ``isinstance`` of a store class;
- the engine asserts nothing about what exists once started (``Running`` holds it);
- outside ``_engine/``, only the members of ``Instance`` that ``_engine/instance.py``
  documents are used.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_tier

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "anarchon"
ENGINE = PACKAGE / "_engine"
STRATEGY_NAMES = {"lease", "stream-id", "idmp", "script"}
STORE_CLASSES = {"LeaseStore", "ClaimOnlyStore", "StreamIdStore", "IdmpStore", "ScriptStore"}


def modules(under: Path = PACKAGE) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(under.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), str(path))


def shown(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"


def test_no_module_imports_an_underscore_name_of_another() -> None:
    found = [
        f"{shown(path, node)}: {alias.name} from {node.module}"
        for path, tree in modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert found == []


def test_nothing_outside_the_testing_kit_imports_it() -> None:
    """Virtual time cannot be reached from production: no module of the package but
    ``anarchon.testing``'s own imports it, and only it sets the virtual clock."""
    kit = PACKAGE / "testing"
    imports, sets = [], []
    for path, tree in modules():
        if path.is_relative_to(kit):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and "testing" in (node.module or "").split("."):
                imports.append(shown(path, node))
            if isinstance(node, ast.Import) and any("testing" in a.name for a in node.names):
                imports.append(shown(path, node))
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "set"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "VIRTUAL"
            ):
                sets.append(shown(path, node))
    assert imports == [] and sets == []


def test_the_public_timers_import_nothing_of_the_engine() -> None:
    path = PACKAGE / "_timers.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [
        shown(path, node)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and "_engine" in (node.module or "")
    ]
    assert found == []


def test_the_engine_asks_nothing_about_its_strategy() -> None:
    found = []
    for path, tree in modules(ENGINE):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "leases":
                found.append(f"{shown(path, node)}: .leases")
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    if isinstance(side, ast.Constant) and side.value in STRATEGY_NAMES:
                        found.append(f"{shown(path, node)}: compares with {side.value!r}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
            ):
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if names & STORE_CLASSES or any(n.endswith("Store") for n in names):
                    found.append(f"{shown(path, node)}: isinstance of a store class")
    assert found == []


def test_the_engine_asserts_nothing_it_holds_once_started() -> None:
    found = [
        shown(path, node)
        for path, tree in modules(ENGINE)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assert)
    ]
    assert found == []


def listed(text: str) -> set[str]:
    return {name.split("(")[0] for name in re.findall(r"``([a-z_]+(?:\(\w*\))?)``", text)}


def documented_instance_members() -> tuple[set[str], set[str]]:
    """The members ``_engine/instance.py``'s docstring lists: those the facade uses, and
    those ``Instance.of(scheduler)`` gives anarchon's integrations."""
    text = ast.get_docstring(ast.parse((ENGINE / "instance.py").read_text(encoding="utf-8")))
    assert text is not None
    facade, rest = text.split("all that code outside the engine uses", 1)[1].split(
        "``Instance.of(scheduler)`` is for anarchon's integrations", 1
    )
    integrations = rest.split("The start opens the store", 1)[0]
    return listed(facade.split("\n\n", 1)[1]), listed(integrations)


def members_used_outside_the_engine() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Each member read on an ``Instance`` outside ``_engine/``: by the facade (on its
    ``self._instance``), and through ``Instance.of(...)`` (on the call itself, or on a
    name bound to it)."""
    by_facade: dict[str, list[str]] = {}
    through_of: dict[str, list[str]] = {}

    def makes_instance(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "Instance"
            and node.func.attr in ("of", "create")
        )

    for path, tree in modules():
        if path.is_relative_to(ENGINE):
            continue
        bound = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and makes_instance(node.value)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if makes_instance(owner) or (isinstance(owner, ast.Name) and owner.id in bound):
                through_of.setdefault(node.attr, []).append(shown(path, node))
            elif (
                isinstance(owner, ast.Attribute)
                and owner.attr == "_instance"
                and isinstance(owner.value, ast.Name)
                and owner.value.id == "self"
                and path.name == "_scheduler.py"
            ):
                by_facade.setdefault(node.attr, []).append(shown(path, node))
    return by_facade, through_of


def test_only_documented_members_of_the_engine_are_used_outside_it() -> None:
    facade, integrations = documented_instance_members()
    by_facade, through_of = members_used_outside_the_engine()
    assert {"state", "events", "jobs", "run_now"} <= facade
    assert {"read_beside", "trace_with", "server_down_since"} <= integrations
    assert by_facade and through_of, "the check found no use of the engine: it reads wrongly"
    assert {k: v for k, v in by_facade.items() if k not in facade | integrations} == {}
    # The integrations reach the engine for what the public Scheduler does not say.
    assert {k: v for k, v in through_of.items() if k not in integrations} == {}
