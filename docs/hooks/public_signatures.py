"""A Griffe extension for the API reference: a signature, a field's type or a base class
shown there names only what a reader can look up on the page (or in Python's and the
dependencies' own documentation), never one of anarchon's internal names.

The code names its types where they are defined, in private modules; the reference shows
what each such name stands for:

- a type alias or constant of a private module (``ConnectionSpec``, ``Outcome``,
  ``DEFAULT_MAX_PAYLOAD_BYTES``) by its value (``str | Mapping[str, Any] | object``,
  ``Literal['ok', 'failed', 'cancelled']``, ``1 << 20``);
- a type variable (``F``, ``K``) by its bound, or the union of its constraints;
- ``**options: Unpack[SomeOptions]`` whose TypedDict is private by ``**options: Any``:
  the docstring's ``Keyword Args`` section lists each option, with its type and meaning
  (tests/test_reference.py checks that it lists every key of the TypedDict);
- a parameter that the implementation of an overloaded function takes as ``object``
  (the overloads, hidden on the page, say what it takes) by the union of what its
  overloads take;
- a default made by an internal function (a dataclass field's ``default_factory``) by
  ``...``, as a stub shows a default (the docstring says what it is);
- the ``Generic[...]`` base of a generic class is left out (it tells a reader nothing).

A private class named anywhere else is left as it is: tests/test_reference.py finds it,
and the page must not show it.

List it after Griffe's ``dataclasses`` extension (mkdocs.yml does), which makes the
dataclasses' constructors: this one rewrites them once they are made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from griffe import (
    Alias,
    Attribute,
    Class,
    Expr,
    ExprBinOp,
    ExprCall,
    ExprKeyword,
    ExprName,
    ExprSubscript,
    Extension,
    Function,
    Module,
    Object,
    ParameterKind,
)

#: The modules whose exports are public; every other name of the package is internal.
PUBLIC_MODULES = ("anarchon", "anarchon.prometheus", "anarchon.otel", "anarchon.web")
_PACKAGE = "anarchon"


def public_paths(package: Module) -> set[str]:
    """The canonical paths of what the public modules export (and of those modules)."""
    paths = set()
    for module_path in PUBLIC_MODULES:
        name = module_path.partition(".")[2]
        if name and name not in package.members:
            continue
        module = package[name] if name else package
        paths.add(module.path)
        for name in module.exports or ():
            target = module[str(name)]
            paths.add(target.final_target.path if isinstance(target, Alias) else target.path)
    return paths


def is_internal(path: str, public: set[str]) -> bool:
    """Whether the object at ``path`` is anarchon's and not public, or private anywhere."""
    if any(part.startswith("_") and not part.startswith("__") for part in path.split(".")):
        return path not in public
    return (path == _PACKAGE or path.startswith(_PACKAGE + ".")) and path not in public


class PublicSignatures(Extension):
    def on_package(self, *, pkg: Module, **_: Any) -> None:
        if pkg.path != _PACKAGE:
            return
        rewriter = _Rewriter(pkg, public_paths(pkg))
        for obj in _objects(pkg):
            if (
                isinstance(obj, Class)
                and "dataclass" in obj.labels
                and "__init__" not in obj.members
            ):
                raise RuntimeError(
                    f"{obj.path} is a dataclass without its __init__ yet: list Griffe's "
                    "'dataclasses' extension before this one"
                )
            rewriter.object(obj)


def _objects(root: Object) -> Iterator[Object]:
    """Every object defined in ``root`` (not the names it imports), ``root`` included."""
    yield root
    for member in root.members.values():
        if isinstance(member, Alias):
            continue
        yield from _objects(member)


class _Rewriter:
    def __init__(self, package: Module, public: set[str]) -> None:
        self.package = package
        self.public = public
        self.collection = package.modules_collection

    def object(self, obj: Object) -> None:
        if isinstance(obj, Function):
            self.function(obj)
        elif isinstance(obj, Attribute):
            obj.annotation = self.expr(obj.annotation)
        elif isinstance(obj, Class):
            obj.bases = [
                self.expr(base)
                for base in obj.bases
                if not (isinstance(base, ExprSubscript) and _path(base.left) == "typing.Generic")
            ]

    def function(self, func: Function) -> None:
        for parameter in func.parameters:
            if _path(parameter.annotation) == "object" and func.overloads:
                parameter.annotation = _overloads_union(func, parameter.name)
            annotation = parameter.annotation
            if parameter.kind is ParameterKind.var_keyword and self._private_unpack(annotation):
                parameter.annotation = ExprName("Any", parent="typing")
            else:
                parameter.annotation = self.expr(annotation)
            parameter.default = self._default(parameter.default)
        func.returns = self.expr(func.returns)

    def _default(self, default: str | Expr | None) -> str | Expr | None:
        """A default, or ``...`` for one made by an internal function (a dataclass
        field's ``default_factory``): the docstring says what it is."""
        default = self.expr(default)
        if any(is_internal(name.canonical_path, self.public) for name in _names(default)):
            return "..."
        return default

    def _private_unpack(self, annotation: str | Expr | None) -> bool:
        return (
            isinstance(annotation, ExprSubscript)
            and _path(annotation.left) in ("typing.Unpack", "typing_extensions.Unpack")
            and is_internal(_path(annotation.slice), self.public)
        )

    def expr(self, expr: Any) -> Any:
        """``expr`` with every internal alias, constant or type variable in it replaced by
        what it stands for (the same object when there is none)."""
        if isinstance(expr, ExprName):
            return self._name(expr)
        if not isinstance(expr, Expr):
            return expr
        changes = {}
        for item in dataclasses.fields(expr):
            if _back_reference(expr, item.name):
                continue
            value = getattr(expr, item.name)
            if isinstance(value, list | tuple):
                new = [self.expr(element) for element in value]
                if any(a is not b for a, b in zip(new, value, strict=True)):
                    changes[item.name] = type(value)(new)
            else:
                new = self.expr(value)
                if new is not value:
                    changes[item.name] = new
        return dataclasses.replace(expr, **changes) if changes else expr

    def _name(self, name: ExprName) -> Any:
        path = name.canonical_path
        if not is_internal(path, self.public):
            return name
        try:
            target = self.collection.get_member(path)
        except KeyError:
            return name
        if isinstance(target, Alias):
            target = target.final_target
        if not isinstance(target, Attribute) or not isinstance(target.value, Expr | str):
            return name  # a class or a function: nothing to show in its place
        value = target.value
        if isinstance(value, ExprCall) and _path(value.function) in (
            "typing.TypeVar",
            "typing_extensions.TypeVar",
        ):
            return self.expr(_type_variable(value)) or name
        return self.expr(value)


def _overloads_union(func: Function, name: str) -> Expr | str | None:
    """What the overloads of ``func`` take as parameter ``name``: the union of their
    annotations (each once), or the implementation's when one of them has none."""
    found: list[Expr | str] = []
    for overload in func.overloads or ():
        try:
            annotation = overload.parameters[name].annotation
        except KeyError:
            annotation = None
        if annotation is None:
            return func.parameters[name].annotation
        for member in _union_members(annotation):
            if str(member) not in {str(each) for each in found}:
                found.append(member)
    return _union(found)


def _union_members(annotation: Expr | str) -> list[Expr | str]:
    if isinstance(annotation, ExprBinOp) and annotation.operator == "|":
        return _union_members(annotation.left) + _union_members(annotation.right)
    return [annotation]


def _union(members: list[Expr | str]) -> Expr | str:
    union = members[0]
    for member in members[1:]:
        union = ExprBinOp(left=union, operator="|", right=member)
    return union


def _type_variable(call: ExprCall) -> Expr | str | None:
    """What a ``TypeVar(...)`` stands for: its bound, or the union of its constraints."""
    for argument in call.arguments:
        if isinstance(argument, ExprKeyword) and argument.name == "bound":
            return argument.value
    constraints = [a for a in call.arguments[1:] if not isinstance(a, ExprKeyword)]
    return _union(constraints) if constraints else None


def _back_reference(expr: Expr, field: str) -> bool:
    """Whether ``expr``'s ``field`` points back at an enclosing object rather than at a
    part of the expression (a name's scope, a keyword argument's function)."""
    return field == "parent" or (field == "function" and isinstance(expr, ExprKeyword))


def _names(expr: object) -> Iterator[ExprName]:
    if isinstance(expr, ExprName):
        yield expr
        return
    if isinstance(expr, Expr):
        for item in dataclasses.fields(expr):
            if not _back_reference(expr, item.name):
                value = getattr(expr, item.name)
                for element in value if isinstance(value, list | tuple) else [value]:
                    yield from _names(element)


def _path(expr: object) -> str:
    return expr.canonical_path if isinstance(expr, Expr) else str(expr)
