"""The CLI reference of the docs (docs/reference/cli.md), generated at every `make docs`
from the argparse parsers themselves: each command's `--help`, exactly as `kvgate`
prints it, so the page cannot drift from the code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
from collections.abc import Iterator

from gateway.cli.main import _DELEGATED, build_parser, main

WIDTH = "96"  # argparse wraps to $COLUMNS: one width, whatever the terminal building it


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    return [
        (name, child)
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, child in action.choices.items()
    ]


def command_paths(
    parser: argparse.ArgumentParser | None = None, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Every command, subcommands after their parent: ("serve",), ("tenants",),
    ("tenants", "create"), ... A command that owns its flags (`kvgate bench`) is walked
    through its own parser."""
    for name, child in _subcommands(parser or build_parser()):
        path = (*prefix, name)
        yield path
        if not prefix and name in _DELEGATED:
            builder = getattr(importlib.import_module(_DELEGATED[name]), "build_parser", None)
            child = builder() if builder is not None else child
        yield from command_paths(child, path)


def help_text(path: tuple[str, ...]) -> str:
    """What `kvgate PATH --help` prints."""
    out = io.StringIO()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*path, "--help"])
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    text = out.getvalue().strip()
    if not text.startswith("usage:"):
        raise RuntimeError(f"kvgate {' '.join(path)} --help printed no usage: {text[:200]!r}")
    return text


def cli_reference() -> str:
    """Markdown: the top-level help, then a section per command."""
    parts = ["```text", help_text(()), "```"]
    for path in command_paths():
        level = "#" * (len(path) + 1)
        parts += ["", f"{level} kvgate {' '.join(path)}", "", "```text", help_text(path), "```"]
    return "\n".join(parts) + "\n"
