"""The site's generated parts: a page that holds ``<!-- generated: NAME -->`` gets, in its
place, Markdown made from the code itself at build time, so that the reference cannot
drift from what anarchon does.

- ``cli``: every command's help, from the parser ``anarchon`` runs;
- ``environment``: every environment variable an option falls back to, from the same
  parser's help;
- ``errors``: every error class, its code and what it means, from ``anarchon``'s exports;
- ``metrics``: every Prometheus metric, its type, labels and help, from the collector.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

_MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")


def _parser() -> argparse.ArgumentParser:
    from anarchon._cli.main import build_parser

    os.environ["COLUMNS"] = "88"  # help wrapped the same on every machine
    return build_parser()


def _commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield "anarchon", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"anarchon {name}", sub


def cli() -> str:
    parts = []
    for name, parser in _commands(_parser()):
        level = "##" if name == "anarchon" else "###"
        parts.append(f"{level} `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def environment() -> str:
    rows: dict[str, list[str]] = {}
    for name, parser in _commands(_parser()):
        for action in parser._actions:
            for variable in re.findall(r"\$([A-Z][A-Z0-9_]+)", action.help or ""):
                option = ", ".join(f"`{flag}`" for flag in action.option_strings)
                rows.setdefault(variable, []).append(f"`{name}` {option}")
    lines = ["| variable | read by |", "| --- | --- |"]
    for variable, users in sorted(rows.items()):
        lines.append(f"| `{variable}` | {'<br>'.join(users)} |")
    return "\n".join(lines) + "\n"


def errors() -> str:
    import anarchon

    lines = ["| error | code | also a | when |", "| --- | --- | --- | --- |"]
    for name in anarchon.__all__:
        value = getattr(anarchon, name)
        if not (isinstance(value, type) and issubclass(value, anarchon.AnarchonError)):
            continue
        builtin = [base.__name__ for base in value.__mro__[1:] if base.__module__ == "builtins"]
        builtin = [b for b in builtin if b not in ("Exception", "BaseException", "object")]
        doc = " ".join((inspect.getdoc(value) or "").split("\n\n")[0].split())
        also = ", ".join(f"`{base}`" for base in builtin) or ""
        lines.append(f"| `{name}` | `{value.code}` | {also} | {doc} |")
    return "\n".join(lines) + "\n"


def metrics() -> str:
    from anarchon.prometheus import SchedulerMetrics

    lines = ["| metric | type | labels | what it counts |", "| --- | --- | --- | --- |"]
    for family in SchedulerMetrics().describe():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = ", ".join(f"`{label}`" for label in _labels(family)) or "none"
        lines.append(f"| `{name}` | {family.type} | {labels} | {family.documentation} |")
    return "\n".join(lines) + "\n"


def _labels(family: Any) -> list[str]:
    labels: list[str] = list(getattr(family, "_labelnames", ()))
    return labels


_GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli,
    "environment": environment,
    "errors": errors,
    "metrics": metrics,
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    def generate(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in _GENERATORS:
            raise ValueError(f"no generator named {name!r}; there are {sorted(_GENERATORS)}")
        return _GENERATORS[name]()

    return _MARKER.sub(generate, markdown)
