"""What a setting's value may be. TOML, a `KVGATE_*` variable or a file edited by hand
before a reload can give any type to any key: each setting is checked against the type
`Settings` declares, and each `[[backends]]` entry's fields against theirs, before
anything uses them, so that a wrong value is a ConfigError naming its key (at start-up a
clear error and exit 2; on a reload a 400 `invalid_config`, the running config kept),
never a TypeError from deep inside. A float must be finite: `inf` and `nan` are TOML's
too. An output parser's name must be one gateway.parsers has.
"""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Any

from gateway.parsers import REASONING_PARSERS, TOOL_PARSERS


class ConfigError(ValueError):
    """A setting that does not validate; `key` names it (`drain_timeout_s`,
    `backends[0].options`)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def check_types(obj: Any, hints: dict[str, Any], skip: frozenset[str] = frozenset()) -> None:
    """Each attribute of `obj` named in `hints` (but `skip`) of its declared type."""
    for name, hint in hints.items():
        value = getattr(obj, name)
        if name not in skip and not _fits(value, hint):
            raise ConfigError(name, f"{name} must be {_described(hint)}, got {_shown(name, value)}")


def _shown(name: str, value: Any) -> str:
    """A wrong value as an error may repeat it: a secret's only by its type, for errors
    reach logs and an admin's HTTP answers."""
    if name.endswith(("key", "secret", "password", "token")):
        return f"a value of type {type(value).__name__}"
    return repr(value)


def table(value: Any, key: str) -> dict[str, Any]:
    """`value`, a TOML table (a dict), or ConfigError."""
    if not isinstance(value, dict):
        raise ConfigError(key, f"{key} must be a table, got {value!r}")
    return value


def text(value: Any, key: str, required: bool = False) -> str:
    """`value`, a string (non-empty if `required`), or ConfigError."""
    if not isinstance(value, str) or (required and not value):
        what = "a non-empty string" if required else "a string"
        raise ConfigError(key, f"{key} must be {what}, got {value!r}")
    return value


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number and math.isfinite(value)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items()
        )
    return isinstance(value, hint)


_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def _described(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("unset" if a is type(None) else _described(a) for a in args)
    if origin is list:
        return f"a list of {_described(args[0]).removeprefix('a ').removeprefix('an ')}s"
    return _NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def check_parsers(reasoning: str | None, tools: str | None, where: str) -> None:
    """ValueError naming the valid parsers for a name gateway.parsers does not have."""
    for kind, name, valid in (
        ("reasoning_parser", reasoning, REASONING_PARSERS),
        ("tool_call_parser", tools, TOOL_PARSERS),
    ):
        if name is not None and name not in valid:
            raise ConfigError(kind, f"{where}{kind} {name!r} is not one of: {', '.join(valid)}")


# Ollama's keep_alive: Go's duration ("10m", "1h30m", "-1s"), or a number of seconds
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_DURATION_CHARS = 32


def keep_alive_s(value: Any) -> float | None:
    """Seconds a model stays loaded after its last request, as Ollama reads `keep_alive`:
    a number of seconds, or a duration string ("5m", "1h30m", "300ms", "0"); negative:
    forever (None); 0: unload once the request is done. ValueError if it is neither."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration or seconds, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and len(value) <= MAX_DURATION_CHARS:
        seconds = _duration(value.strip())
    else:
        raise ValueError(f"keep_alive must be a duration (5m, 1h) or seconds, got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"keep_alive must be finite, got {value!r}")
    return None if seconds < 0 else seconds


def _duration(text: str) -> float:
    try:
        return float(text)  # "300": seconds, as Ollama's server takes it
    except ValueError:
        pass
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    parts = _DURATION_PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"keep_alive must be a duration (5m, 1h30m) or seconds, got {text!r}")
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
