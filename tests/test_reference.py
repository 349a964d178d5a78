"""The API reference tells what every public name takes and holds. Each object that
docs/reference/api.md and events.md render (their ``::: name`` lines, with the options
under them and mkdocs.yml's) is loaded as the site loads it, with Griffe, mkdocs.yml's
docstring style and its Griffe extensions; then:

- every parameter it shows (a function's, a method's, a class's constructor) and every
  field of a class (a dataclass's, a TypedDict's, an attribute it shows) has a
  description; the options a ``**options: Unpack[SomeOptions]`` takes each have one;
- every value of a ``Literal`` type (``RunStatus``, an event's ``outcome``) has one;
- no signature, field type or base names an internal object (one that no public module
  exports) or a ``_``-prefixed one;
- every public name has a ``:::`` line.

No server needed."""

from __future__ import annotations

import importlib
import re
import typing
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import griffe
import pytest
import yaml
from griffe import (
    Alias,
    Attribute,
    Class,
    DocstringSectionKind,
    Expr,
    ExprKeyword,
    ExprName,
    ExprSubscript,
    Function,
    Module,
    Object,
    ParameterKind,
)

import anarchon

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "docs" / "reference" / "api.md", ROOT / "docs" / "reference" / "events.md"]
#: The modules whose exports are public (api.md says so); every other name is internal.
PUBLIC_MODULES = ("anarchon", "anarchon.prometheus", "anarchon.otel", "anarchon.web")
#: The optional modules' public names that api.md shows, beside ``anarchon.__all__``.
EXTRA_PUBLIC = (
    "anarchon.prometheus.instrument",
    "anarchon.otel.instrument",
    "anarchon.web.dashboard",
)

_DIRECTIVE = re.compile(r"^::: (?P<name>[\w.]+)[ \t]*$")


# ------------------------------------------------------------------ what the site reads


class _Loader(yaml.SafeLoader):
    """mkdocs.yml's ``!!python/name:`` tags name Markdown extensions' functions: read as
    None here (the handler's options are all this test needs)."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def handler_options() -> dict[str, Any]:
    """The Python handler's global options in mkdocs.yml."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            options: dict[str, Any] = plugin["mkdocstrings"]["handlers"]["python"]["options"]
            return options
    raise AssertionError("mkdocs.yml has no mkdocstrings plugin")


@dataclass(frozen=True)
class Entry:
    """One ``::: name`` line of a page and the options under it."""

    name: str
    where: str
    options: dict[str, Any] = field(default_factory=dict)


def entries(pages: list[Path] = PAGES) -> list[Entry]:
    found = []
    for page in pages:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            match = _DIRECTIVE.match(line)
            if not match:
                continue
            block = []
            for following in lines[number + 1 :]:
                if following.strip() and not following.startswith("    "):
                    break
                block.append(following[4:])
            local = yaml.safe_load("\n".join(block)) or {}
            where = f"{page.name}:{number + 1}"
            found.append(Entry(match["name"], where, local.get("options") or {}))
    return found


def load(options: dict[str, Any], search_path: Path = ROOT / "src") -> Module:
    """The package as the site loads it: same style, same extensions."""
    extensions = griffe.load_extensions(
        *(
            str(ROOT / extension) if extension.endswith(".py") else extension
            for extension in options.get("extensions", ())
        )
    )
    package = griffe.load(
        "anarchon",
        search_paths=[search_path],
        docstring_parser=options["docstring_style"],
        docstring_options=options.get("docstring_options"),
        extensions=extensions,
    )
    assert isinstance(package, Module)
    return package


# ------------------------------------------------------------------ public and internal


def public_paths(package: Module) -> set[str]:
    """Where each public name is defined (its canonical path), and the public modules."""
    paths = set()
    for module_path in PUBLIC_MODULES:
        name = module_path.partition(".")[2]
        if name and name not in package.members:
            continue  # (the check's own test package has none)
        module = package[name] if name else package
        paths.add(module.path)
        for name in module.exports or ():
            paths.add(_target(module[str(name)]).path)
    return paths


def is_internal(path: str, public: set[str]) -> bool:
    if path in public:
        return False
    if any(part.startswith("_") and not part.startswith("__") for part in path.split(".")):
        return True
    return path == "anarchon" or path.startswith("anarchon.")


def _target(obj: Object | Alias) -> Object:
    return obj.final_target if isinstance(obj, Alias) else obj


# ------------------------------------------------------------------ what a page renders


def _keep(name: str, filters: list[str]) -> bool:
    """mkdocstrings' filters: the last one that matches decides (``!`` rejects)."""
    keep = True
    for pattern in filters:
        negated = pattern.startswith("!")
        if re.search(pattern.lstrip("!"), name):
            keep = not negated
    return keep


def rendered_members(cls: Class, options: dict[str, Any], *, root: bool) -> list[Object]:
    """The members of ``cls`` that mkdocstrings renders (its own, not inherited ones):
    those of the entry's ``members`` list for the root object, else those the filters
    keep that have a docstring (or all, with ``show_if_no_docstring``)."""
    members = [member for member in cls.members.values() if not member.inherited]
    listed = options.get("members") if root else None
    if listed is not None:
        chosen = [member for member in members if member.name in set(listed)]
        missing = set(listed) - {member.name for member in chosen}
        assert not missing, f"{cls.path}: members {sorted(missing)} do not exist"
        return [_target(member) for member in chosen]
    chosen = [member for member in members if _keep(member.name, options.get("filters", []))]
    if not options.get("show_if_no_docstring"):
        chosen = [member for member in chosen if member.has_docstrings]
    return [_target(member) for member in chosen]


# ------------------------------------------------------------------ what a docstring says


def _sections(obj: Object, kind: DocstringSectionKind) -> list[Any]:
    if obj.docstring is None:
        return []
    items = []
    for section in obj.docstring.parsed:
        if section.kind is kind:
            items.extend(section.value)
    return items


def _described(items: list[Any]) -> dict[str, str]:
    return {item.name.lstrip("*"): item.description.strip() for item in items}


def parameter_descriptions(obj: Class | Function) -> dict[str, str]:
    """What the docstring says of each parameter (for a class, with merged ``__init__``:
    its docstring and ``__init__``'s)."""
    found = _described(_sections(obj, DocstringSectionKind.parameters))
    if isinstance(obj, Class) and "__init__" in obj.members:
        init = _target(obj.members["__init__"])
        found = _described(_sections(init, DocstringSectionKind.parameters)) | found
    return found


def field_descriptions(cls: Class) -> dict[str, str]:
    """What ``cls`` and the classes it derives from say of their fields: an ``Attributes``
    entry, or the field's own docstring."""
    found: dict[str, str] = {}
    for ancestor in reversed(cls.mro()):
        found |= _own_field_descriptions(ancestor)
    return found | _own_field_descriptions(cls)


def _own_field_descriptions(cls: Class) -> dict[str, str]:
    found = {}
    for name, member in cls.members.items():
        if isinstance(member, Attribute) and member.docstring and not member.inherited:
            found[name] = member.docstring.value.strip()
    return found | _described(_sections(cls, DocstringSectionKind.attributes))


def is_record(cls: Class) -> bool:
    """A dataclass or a TypedDict: its constructor's parameters are its fields."""
    if "dataclass" in cls.labels:
        return True
    return any(
        _path(base) in ("typing.TypedDict", "typing_extensions.TypedDict") for base in cls.bases
    )


def fields_of(cls: Class) -> list[Attribute]:
    """The public data attributes ``cls`` itself declares (fields, class and instance
    attributes), not its properties."""
    found = []
    for name, member in cls.members.items():
        if member.inherited or isinstance(member, Alias) or name.startswith("_"):
            continue
        if not isinstance(member, Attribute) or "property" in member.labels:
            continue
        found.append(member)
    return found


# ------------------------------------------------------------------ expressions


def _path(expr: object) -> str:
    return expr.canonical_path if isinstance(expr, Expr) else str(expr)


def names_in(expr: object) -> Iterator[ExprName]:
    """Every name an expression mentions."""
    if isinstance(expr, ExprName):
        yield expr
        if isinstance(expr.parent, ExprName):
            yield from names_in(expr.parent)
        return
    if not isinstance(expr, Expr):
        return
    for item in fields(expr):
        if _back_reference(expr, item.name):
            continue
        value = getattr(expr, item.name)
        for element in value if isinstance(value, list | tuple) else [value]:
            yield from names_in(element)


def _back_reference(expr: Expr, field: str) -> bool:
    """Whether ``expr``'s ``field`` points back at an enclosing object (a name's scope, a
    keyword argument's function) rather than at a part of the expression."""
    return field == "parent" or (field == "function" and isinstance(expr, ExprKeyword))


def literal_values(expr: object) -> list[str]:
    """The string values of every ``Literal[...]`` in an expression."""
    values: list[str] = []
    if isinstance(expr, ExprSubscript) and _path(expr.left) in (
        "typing.Literal",
        "typing_extensions.Literal",
    ):
        elements = getattr(expr.slice, "elements", [expr.slice])
        return [str(e).strip("'\"") for e in elements if isinstance(e, str) and e[:1] in "'\""]
    if isinstance(expr, Expr):
        for item in fields(expr):
            if _back_reference(expr, item.name):
                continue
            value = getattr(expr, item.name)
            for element in value if isinstance(value, list | tuple) else [value]:
                values.extend(literal_values(element))
    return values


def _mentions(description: str, value: str) -> bool:
    return f'"{value}"' in description


# ------------------------------------------------------------------ the check


@dataclass
class Report:
    public: set[str]
    problems: list[str] = field(default_factory=list)
    #: Keys of the private TypedDicts that ``**kwargs`` take, and the ones documented.
    unpacked: dict[str, set[str]] = field(default_factory=dict)
    documented_options: set[str] = field(default_factory=set)

    def add(self, where: str, problem: str) -> None:
        self.problems.append(f"{where}: {problem}")

    def shown(self, where: str, what: str, expr: object) -> None:
        """``expr`` is shown on the page: it names no internal object."""
        for name in names_in(expr):
            path = name.canonical_path
            if is_internal(path, self.public):
                self.add(where, f"{what} names {path} ({expr}), which is internal")
                return


def check(entry: Entry, package: Module, options: dict[str, Any], report: Report) -> None:
    local = options | entry.options
    obj = _target(package[entry.name.split(".", 1)[1]])
    _check_object(obj, local, report, root=True)


def _check_object(obj: Object, options: dict[str, Any], report: Report, *, root: bool) -> None:
    if isinstance(obj, Class):
        _check_class(obj, options, report, root=root)
    elif isinstance(obj, Function):
        _check_function(obj, report)
    elif isinstance(obj, Attribute):
        _check_attribute(obj, report)


def _check_class(cls: Class, options: dict[str, Any], report: Report, *, root: bool) -> None:
    where = cls.path
    for base in cls.bases:
        report.shown(where, "a base", base)
    fields_said = field_descriptions(cls)
    if options.get("merge_init_into_class"):
        said = parameter_descriptions(cls)
        own: set[str] = set()
        if is_record(cls):
            # Its own fields are described as fields (checked below); inherited ones
            # by its bases.
            said = fields_said | said
            own = {attribute.name for attribute in fields_of(cls)}
        _check_parameters(cls, cls.parameters, said, report, described_elsewhere=own)
    source = cls.source
    for name in _described(_sections(cls, DocstringSectionKind.attributes)):
        if name not in cls.all_members and f"self.{name} =" not in source:
            report.add(where, f"the Attributes section names {name!r}, which it does not have")
    members = rendered_members(cls, options, root=root)
    listed = root and options.get("members") is not None
    for attribute in fields_of(cls):
        if listed and attribute not in members and not is_record(cls):
            continue  # not on the page (its entry lists the members it shows)
        if not fields_said.get(attribute.name):
            report.add(where, f"field {attribute.name!r} has no description")
        report.shown(f"{where}.{attribute.name}", "its type", attribute.annotation)
        _check_literals(
            f"{where}.{attribute.name}", attribute.annotation, fields_said.get(attribute.name, ""),
            report,
        )  # fmt: skip
    for member in members:
        if isinstance(member, Attribute):
            _check_attribute(member, report)
        else:
            _check_object(member, options, report, root=False)


def _check_function(func: Function, report: Report) -> None:
    said = parameter_descriptions(func)
    _check_parameters(func, func.parameters, said, report)
    report.shown(func.path, "its return type", func.returns)


def _check_parameters(
    obj: Class | Function,
    parameters: Any,
    said: dict[str, str],
    report: Report,
    *,
    described_elsewhere: Collection[str] = (),
) -> None:
    where = obj.path
    for parameter in parameters:
        if parameter.name in ("self", "cls"):
            continue
        report.shown(where, f"parameter {parameter.name!r}", parameter.annotation)
        report.shown(where, f"the default of {parameter.name!r}", parameter.default)
        if parameter.name in described_elsewhere:
            continue
        if not said.get(parameter.name):
            report.add(where, f"parameter {parameter.name!r} has no description")
        _check_literals(
            f"{where}({parameter.name})", parameter.annotation, said.get(parameter.name, ""),
            report,
        )  # fmt: skip
        if parameter.kind is ParameterKind.var_keyword and isinstance(obj, Function):
            _record_options(obj, report)
    other = _sections(obj, DocstringSectionKind.other_parameters)
    for option in other:
        if not option.description.strip():
            report.add(where, f"option {option.name!r} has no description")
        report.shown(where, f"option {option.name!r}", option.annotation)
        _check_literals(f"{where}({option.name})", option.annotation, option.description, report)
        report.documented_options.add(f"{where}:{option.name}")


def _record_options(func: Function, report: Report) -> None:
    """The keys of the TypedDicts that the function's ``**kwargs`` unpack (in it or its
    overloads), read from the code itself."""
    runtime = _runtime(func)
    if runtime is None:
        return
    keys: set[str] = set()
    for variant in [runtime, *typing.get_overloads(runtime)]:
        for hint in typing.get_type_hints(variant, include_extras=True).values():
            if typing.get_origin(hint) is typing.Unpack:
                (typed_dict,) = typing.get_args(hint)
                keys |= set(typed_dict.__annotations__)
    if keys:
        report.unpacked[func.path] = keys


def _runtime(func: Function) -> Any:
    parts = func.path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            value = getattr(value, part)
        return value
    return None


def _check_attribute(attribute: Attribute, report: Report) -> None:
    where = attribute.path
    docstring = attribute.docstring.value if attribute.docstring else ""
    if not docstring.strip():
        report.add(where, "has no description")
    report.shown(where, "its type", attribute.annotation)
    if attribute.parent is not None and attribute.parent.is_module:
        # A module's type alias: ``Name = Literal[...]``, each value a bullet.
        report.shown(where, "its value", attribute.value)
        for value in literal_values(attribute.value):
            bullet = re.compile(rf'^\s*- ``"{re.escape(value)}"``\S*:? \S', re.M)
            if not bullet.search(docstring):
                report.add(where, f'value "{value}" has no bullet (- ``"{value}"``: what)')


def _check_literals(where: str, annotation: object, description: str, report: Report) -> None:
    for value in literal_values(annotation):
        if not _mentions(description, value):
            report.add(where, f'the description does not say what "{value}" means')


def check_pages(
    pages: list[Path] = PAGES, search_path: Path = ROOT / "src"
) -> tuple[Report, list[Entry]]:
    options = handler_options()
    package = load(options, search_path)
    report = Report(public_paths(package))
    found = entries(pages)
    for entry in found:
        check(entry, package, options, report)
    return report, found


def undocumented_options(report: Report) -> list[str]:
    """Keys of a ``**kwargs`` TypedDict that no function taking it documents."""
    missing = []
    for func, keys in report.unpacked.items():
        for key in sorted(keys):
            if not any(
                documented.endswith(f":{key}")
                and any(
                    documented.startswith(other + ":")
                    for other, other_keys in report.unpacked.items()
                    if key in other_keys
                )
                for documented in report.documented_options
            ):
                missing.append(f"{func}: option {key!r} is documented nowhere on the page")
    return missing


# ------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def checked() -> tuple[Report, list[Entry]]:
    return check_pages()


def test_the_pages_render_objects_to_check(checked: tuple[Report, list[Entry]]) -> None:
    _, found = checked
    assert len(found) > 50
    assert "anarchon.Scheduler" in {entry.name for entry in found}


def test_every_public_name_has_an_entry(checked: tuple[Report, list[Entry]]) -> None:
    _, found = checked
    shown = {entry.name for entry in found}
    public = {f"anarchon.{name}" for name in anarchon.__all__} | set(EXTRA_PUBLIC)
    assert not sorted(public - shown), "no ::: line for these public names"


def test_every_parameter_field_and_value_shown_has_a_description_and_no_internal_type(
    checked: tuple[Report, list[Entry]],
) -> None:
    report, _ = checked
    problems = report.problems + undocumented_options(report)
    assert not problems, "\n".join(problems)


def test_the_check_finds_what_is_missing(tmp_path: Path) -> None:
    """The check above, on a package whose reference misses one of each."""
    package = tmp_path / "src" / "anarchon"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(_FLAWED)
    page = tmp_path / "api.md"
    page.write_text(
        "".join(f"::: anarchon.{name}\n\n" for name in ("Thing", "Box", "Colour", "make"))
    )
    report, _ = check_pages([page], tmp_path / "src")
    assert sorted(report.problems) == sorted(
        [
            "anarchon.Thing: field 'size' has no description",
            "anarchon.Thing: field 'weight' has no description",
            "anarchon.Thing: field 'helper' has no description",
            "anarchon.Thing.helper: its type names anarchon._Helper (_Helper | None), "
            "which is internal",
            "anarchon.Thing: parameter 'helper' names anarchon._Helper (_Helper | None), "
            "which is internal",
            'anarchon.Thing.shape: the description does not say what "round" means',
            "anarchon.Thing: the Attributes section names 'colour', which it does not have",
            "anarchon.Box: parameter 'depth' has no description",
            "anarchon.Box: field 'width' has no description",
            "anarchon.Box.fill: parameter 'how' has no description",
            "anarchon.Box.fill: parameter 'how' names anarchon._Helper (_Helper), "
            "which is internal",
            'anarchon.Colour: value "blue" has no bullet (- ``"blue"``: what)',
            "anarchon.make: parameter 'count' has no description",
            "anarchon.make: its return type names anarchon._Helper (_Helper), which is internal",
        ]
    )


def test_the_options_of_a_job_and_a_timer_kind_are_checked(
    checked: tuple[Report, list[Entry]],
) -> None:
    """The keys of the TypedDicts that ``job()`` and ``timer()`` unpack are read from the
    code (a new option is found undocumented)."""
    report, _ = checked
    job = report.unpacked["anarchon._scheduler.Scheduler.job"]
    assert {"every_ms", "overlap", "retry_on", "timeout_ms"} <= job
    assert report.unpacked["anarchon._scheduler.Scheduler.timer"] == {
        "max_attempts",
        "retry_delay_ms",
        "buckets",
        "max_concurrent",
        "max_concurrent_fleet",
        "rate_limit",
        "group_by",
        "max_concurrent_per_group",
    }
    assert not undocumented_options(report)
    report.documented_options.discard("anarchon._scheduler.Scheduler.job:overlap")
    assert undocumented_options(report) == [
        "anarchon._scheduler.Scheduler.job: option 'overlap' is documented nowhere on the page",
        "anarchon._scheduler.Scheduler.add_job: option 'overlap' is documented nowhere on the page",
    ]


_FLAWED = '''
from dataclasses import dataclass
from typing import Literal

__all__ = ["Box", "Colour", "Thing", "make"]

Colour = Literal["red", "blue"]
"""A colour:

- ``"red"``: warm.
"""


class _Helper:
    pass


@dataclass
class Thing:
    """A thing.

    Attributes:
        name: Its name.
        shape: ``"square"``, or something else.
        colour: Its colour.
    """

    name: str
    size: int
    weight: float
    shape: Literal["square", "round"]
    helper: _Helper | None = None


class Box:
    """A box.

    Args:
        width: How wide.
    """

    def __init__(self, width: int, depth: int) -> None:
        self.width = width

    def fill(self, how: _Helper) -> None:
        """Fill it."""


def make(name: str, count: int) -> _Helper:
    """Make one.

    Args:
        name: Its name.
    """
    return _Helper()
'''
