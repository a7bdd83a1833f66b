"""The argument parser of every `kvgate` command. argparse's, with two changes:

- a flag is accepted only spelled in full: argparse takes any unambiguous prefix, so
  `--daily-token 5` silently set `--daily-tokens`, and a flag added later can change
  what an old abbreviation means;
- an unknown flag is refused by the subcommand it was given to, with that subcommand's
  usage and the flag it most likely meant. argparse hands a subcommand's unknown
  arguments up to the top-level parser, whose usage lists the subcommands, not the
  flags the user was typing.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    """An ArgumentParser without abbreviations whose subcommands refuse unknown
    arguments themselves. Subparsers are built of the parent's class, so a whole tree
    made from one Parser behaves alike."""

    def __init__(self, *args: Any, allow_abbrev: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)
        self.register("action", "parsers", _Subcommands)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.refuse(extras)
        return parsed

    def refuse(self, extras: list[str]) -> NoReturn:
        """Exit with this parser's usage, naming the arguments it does not know."""
        self.error(f"unrecognized arguments: {' '.join(extras)}{self.suggest(extras)}")

    def suggest(self, extras: list[str]) -> str:
        """' (did you mean --port?)' for the flags among `extras` close to one of ours."""
        known = [option for option in self._option_string_actions if option.startswith("--")]
        hints = []
        for arg in extras:
            flag = arg.split("=", 1)[0]
            if not flag.startswith("--"):
                continue
            near = difflib.get_close_matches(flag, known, n=1)
            if near:
                hints.append((flag, near[0]))
        if not hints:
            return ""
        if len(hints) == 1:
            return f" (did you mean {hints[0][1]}?)"
        return " (did you mean " + ", ".join(f"{m} for {f}" for f, m in hints) + "?)"


class _Subcommands(argparse._SubParsersAction):
    """Subcommands that refuse what they do not parse, instead of handing it up."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        super().__call__(parser, namespace, values, option_string)
        leftover = getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, None)
        chosen = self._name_parser_map[values[0]]
        if leftover and isinstance(chosen, Parser):
            chosen.refuse(leftover)
