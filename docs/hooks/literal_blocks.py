"""A Griffe extension for the API reference: anarchon's docstrings end a sentence that
introduces an example with ``::`` (reStructuredText's literal block, read as such by
``help()`` readers and editors); the site shows it as one ``:``, the example below it
being a code block already."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_LITERAL = re.compile(r"::(?=\n\s*\n)")


class LiteralBlocks(Extension):
    def on_instance(self, *, obj: Object, **_: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _LITERAL.sub(":", obj.docstring.value)
