"""Dataclasses as JSON objects: the one encoder and strict decoder every record shares.

A record crossing to another process must arrive as the same record or be refused with a
message naming the field: unknown and missing keys, wrong types (a bool is not an int,
a float must be finite, as JSON has no NaN) are errors, never silently coerced. The
decoder reads the dataclass's own type hints, so a new field needs no wire code.
`bytes` (an image's pixels) travel as standard base64 strings, as JSON has no bytes;
a string that is not strict base64 is refused like any other mistyped field.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import math
import types
import typing
from typing import Any, ClassVar, Self

_NAMES = {int: "an integer", float: "a finite number", str: "a string", bool: "a boolean"}


class Record:
    """Mixin for a dataclass that crosses a process boundary as a JSON object."""

    # what a malformed object raises: a request's fields are the client's fault (400)
    wire_error: ClassVar[type[ValueError]] = ValueError

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists, tuples and scalars: what `json.dumps` takes."""
        return _plain(dataclasses.asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        """The record `to_dict` (or its JSON round trip) gave, or `wire_error`."""
        return cls(**decode_fields(cls, data, cls.wire_error))


def _plain(value: Any) -> Any:
    """`asdict`'s output with every `bytes` as its base64 string (in place)."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dict):
        for k, v in value.items():
            value[k] = _plain(v)
    elif isinstance(value, list):
        value[:] = [_plain(v) for v in value]
    elif isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_types(record: Any, error: type[ValueError]) -> None:
    """Raise `error` naming the first field of the dataclass `record` whose value does not
    have its declared type (what `decode` would refuse on the wire)."""
    hints = _hints(type(record))
    for f in dataclasses.fields(record):
        decode(hints[f.name], getattr(record, f.name), f.name, error)


def decode_fields(cls: type, data: Any, error: type[ValueError]) -> dict[str, Any]:
    """`data`'s fields for `cls(**fields)`, each checked (and nested records decoded)."""
    name = cls.__name__
    if not isinstance(data, dict):
        raise error(f"{name} must be a JSON object, got {show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise error(f"unknown {name} field(s): {', '.join(show(k) for k in unknown)}")
    missing = [
        n
        for n, f in fields.items()
        if n not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise error(f"{name} is missing field(s): {', '.join(missing)}")
    hints = _hints(cls)
    return {k: decode(hints[k], v, k, error) for k, v in data.items()}


def decode(hint: Any, value: Any, name: str, error: type[ValueError]) -> Any:
    """`value` as type `hint` (lists, tuples, `X | None`, records, scalars), or `error`
    naming the field `name`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` is used
        return decode(inner, value, name, error)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise error(f"{name} must be a list, got {show(value)}")
        return [decode(args[0], v, f"{name}[{i}]", error) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise error(f"{name} must be a list of {len(args)} items, got {show(value)}")
        return tuple(
            decode(a, v, f"{name}[{i}]", error)
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if isinstance(hint, type) and issubclass(hint, Record):
        if isinstance(value, hint):  # a nested record in Python (check_types)
            check_types(value, error)
            return value
        return hint.from_dict(value)
    if hint is bytes:
        return _bytes(value, name, error)
    if hint not in _NAMES:
        raise TypeError(f"{name}: no wire decoding for {hint!r}")  # a new field's type
    if not _is(hint, value):
        raise error(f"{name} must be {_NAMES[hint]}, got {show(value)}")
    return value


def _bytes(value: Any, name: str, error: type[ValueError]) -> bytes:
    if isinstance(value, bytes):  # a record in Python (check_types)
        return value
    if not isinstance(value, str):
        raise error(f"{name} must be a base64 string, got {show(value)}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise error(f"{name} must be a base64 string, got {show(value)}") from None


def _is(hint: type, value: Any) -> bool:
    if isinstance(value, bool):
        return hint is bool
    if hint is float:  # an int is a number too (JSON writes 1.0 as 1 in some clients)
        return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    return isinstance(value, hint)


def show(value: Any) -> str:
    """A value for an error message, cut short: it may be a client's megabyte string."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
