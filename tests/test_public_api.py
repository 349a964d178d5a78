"""The public API as a user meets it: names that say where to import them from, one
error hierarchy, types an introspecting framework can read. No server needed."""

from __future__ import annotations

import inspect
import typing

import pytest

import anarchon
import anarchon.clients
from anarchon import AnarchonError, ServerReplyError, TransportError

PUBLIC = [getattr(anarchon, name) for name in anarchon.__all__]
PUBLIC_DEFINED = [obj for obj in PUBLIC if inspect.isclass(obj) or inspect.isfunction(obj)]


@pytest.mark.parametrize("obj", PUBLIC_DEFINED, ids=lambda obj: obj.__name__)
def test_public_names_report_the_module_they_are_imported_from(obj: type) -> None:
    assert f"{obj.__module__}.{obj.__qualname__}" == f"anarchon.{obj.__name__}"


@pytest.mark.parametrize(
    "cls", [obj for obj in PUBLIC_DEFINED if inspect.isclass(obj)], ids=lambda c: c.__name__
)
def test_the_type_hints_of_public_classes_resolve(cls: type) -> None:
    """A framework that reads a class's annotations (a web framework's response model, a
    serializer) resolves them through the module the class names."""
    hints = typing.get_type_hints(cls)
    assert all(hint is not None for hint in hints.values())


def test_transport_and_reply_errors_are_anarchon_errors_with_codes() -> None:
    reply = ServerReplyError("NOPERM this user has no permissions to run the 'get' command")
    lost = TransportError("connection reset")
    assert isinstance(reply, AnarchonError) and isinstance(lost, AnarchonError)
    assert reply.kind == "NOPERM"
    assert reply.code == "ANARCHON_SERVER_REPLY" and lost.code == "ANARCHON_TRANSPORT"
    assert str(reply) == (
        "ANARCHON_SERVER_REPLY: NOPERM this user has no permissions to run the 'get' command"
    )
    # The adapters' seam hands on the same classes.
    assert anarchon.clients.ServerReplyError is ServerReplyError
    assert anarchon.clients.TransportError is TransportError


def test_every_error_class_has_its_own_code() -> None:
    errors = [obj for obj in PUBLIC if inspect.isclass(obj) and issubclass(obj, AnarchonError)]
    codes = [cls.code for cls in errors]
    assert len(errors) >= 13
    assert len(set(codes)) == len(codes), codes
