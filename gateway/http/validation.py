"""pydantic's validation errors in the words of the API they answer for, on every route:
each names the field by its path in the body (`input[0][1]`, `messages[2].content`) and
says what the field takes ("must be an integer", "must be at most 2147483647"), nothing of
how it is checked.

Two things in pydantic's errors are the implementation's: its messages name Python types
("a valid dictionary or instance of TextPart"), and the location of an error inside a
union carries the label of the member the value was tried against (`str`,
`list[function-before[...]]`, a model's class name, a discriminator's tag). The messages
are rewritten here by error type; the labels are told from the body's own keys and
indices by walking the body along the location, and dropped. A value that no member of
a union takes fails once per member; the members that got furthest into the value speak
for the union ("input[0][1]: must be an integer"), and where several got as far their
kinds are joined ("input[0]: must be a string, an integer or an array").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

MAX_ERRORS = 10  # said in one message; the rest are counted
_KEY_CHARS = 40  # of a body's own key, in a path

# error types that say which JSON type a value must be
_KINDS = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "list_type": "an array",
    "tuple_type": "an array",
    "set_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "dataclass_type": "an object",
    "none_required": "null",
}
# the other error types, in words filled from the error's context
_RULES = {
    "missing": "is required",
    "extra_forbidden": "is not a recognized argument",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "multiple_of": "must be a multiple of {multiple_of}",
    "finite_number": "must be a finite number",
    "string_too_short": "must be at least {min_length} characters long",
    "string_too_long": "must be at most {max_length} characters long",
    "too_short": "must hold at least {min_length} items",
    "too_long": "must hold at most {max_length} items",
    "string_pattern_mismatch": "must match the pattern {pattern}",
    "union_tag_invalid": "must be one of {expected_tags}",
    "union_tag_not_found": "is required",
}
# pydantic's own names for union members that read like a field's
_BARE_LABELS = frozenset({"str", "int", "float", "bool", "bytes", "none", "any", "list", "dict"})
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLAIN = re.compile(r"[a-z0-9 ,.'-]*")  # no class name, no repr


def described(error: ValidationError, body: Any) -> tuple[str, str | None]:
    """The message for `error`, raised validating `body` (the parsed JSON, or None where
    there is none), and the path of its first field (OpenAI's `param`; None: the body)."""
    found = [_Found.of(i, err, body) for i, err in enumerate(error.errors(include_url=False))]
    kept = sorted(_furthest(found, 0), key=lambda f: f.order)
    by_path: dict[str, list[_Found]] = {}
    for f in kept:
        by_path.setdefault(f.path, []).append(f)
    lines = [f"{path or 'body'}: {_words(group)}" for path, group in by_path.items()]
    message = "; ".join(lines[:MAX_ERRORS])
    if len(lines) > MAX_ERRORS:
        message += f"; and {len(lines) - MAX_ERRORS} more"
    return message, (kept[0].path or None) if kept else None


@dataclass(frozen=True)
class _Label:
    """A union member's label in an error's location: not a place in the body."""

    name: str


@dataclass(frozen=True)
class _Found:
    order: int  # pydantic's order, kept in the message
    parts: tuple[str | int | _Label, ...]
    type: str
    ctx: dict[str, Any]
    msg: str

    @classmethod
    def of(cls, order: int, err: Any, body: Any) -> _Found:
        ctx = err.get("ctx") or {}
        parts = _parts(err["loc"], body, err["type"] == "missing") + _inner(err["type"], ctx)
        return cls(order, parts, err["type"], ctx, err["msg"])

    @property
    def depth(self) -> int:
        """How far into the body it is."""
        return sum(not isinstance(p, _Label) for p in self.parts)

    @property
    def path(self) -> str:
        out = ""
        for part in self.parts:
            if isinstance(part, int):
                out += f"[{part}]"
            elif isinstance(part, str):
                if _IDENTIFIER.fullmatch(part):
                    out += f".{part}" if out else part
                else:
                    key = part if len(part) <= _KEY_CHARS else part[:_KEY_CHARS] + "..."
                    out += f"[{json.dumps(key)}]"
        return out


def _inner(kind: str, ctx: dict[str, Any]) -> tuple[str | int, ...]:
    """The place inside the value an error is about, where the error says: a custom
    validator's refusal names it (`at`: gateway.schemas.base.Refused), a discriminated
    union's unknown tag is its discriminator field's."""
    if kind.startswith("union_tag_"):
        field = re.fullmatch(r"'(\w+)'", str(ctx.get("discriminator", "")))
        return (field.group(1),) if field else ()
    return tuple(getattr(ctx.get("error"), "at", ()))


_LOST = object()  # where the walk no longer knows the body (a validator reshaped it)


def _parts(loc: tuple[str | int, ...], body: Any, missing: bool) -> tuple:
    """The location with each union member's label marked: a key the body has at that
    place is a field (a missing field is the last place); anything else is a label."""
    node, out = body, []
    for i, item in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(item, int):
            out.append(item)
            fits = isinstance(node, list) and -len(node) <= item < len(node)
            node = node[item] if fits else _LOST
        elif node is _LOST:
            label = not _FIELD_NAME.fullmatch(item) or item in _BARE_LABELS
            out.append(_Label(item) if label else item)
        elif isinstance(node, dict) and item in node and not _is_tag(node, item, loc[i + 1 :]):
            out.append(item)
            node = node[item]
        elif isinstance(node, dict) and last and missing:
            out.append(item)
        else:
            out.append(_Label(item))
    return tuple(out)


def _is_tag(node: dict, item: str, rest: tuple[str | int, ...]) -> bool:
    """Whether `item`, a key of `node`, is there the tag of a discriminated union (the
    value of its `type`) rather than the field: the field would be gone into next."""
    if node.get("type") != item or not rest:
        return False
    value, step = node[item], rest[0]
    goes_in = isinstance(value, dict) and isinstance(step, str)
    return not (goes_in or (isinstance(value, list) and isinstance(step, int)))


def _furthest(found: list[_Found], start: int) -> list[_Found]:
    """The errors that count: each union's (the first label from `start` on) are those of
    the members that got furthest into the value, chosen the same way inside them."""
    kept: list[_Found] = []
    unions: dict[tuple, dict[str, list[_Found]]] = {}
    for f in found:
        at = next((i for i in range(start, len(f.parts)) if isinstance(f.parts[i], _Label)), None)
        if at is None:
            kept.append(f)
        else:
            members = unions.setdefault(f.parts[:at], {})
            members.setdefault(f.parts[at].name, []).append(f)  # type: ignore[union-attr]
    for point, members in unions.items():
        chosen = [_furthest(errs, len(point) + 1) for errs in members.values()]
        deepest = max(max(f.depth for f in errs) for errs in chosen)
        kept += [f for errs in chosen if max(f.depth for f in errs) == deepest for f in errs]
    return kept


def _words(group: list[_Found]) -> str:
    """What one field takes, from its errors: the kinds it may be, then any other rule."""
    kinds: list[str] = []
    rules: list[str] = []
    for f in group:
        if f.type in _KINDS:
            kinds.append(_KINDS[f.type])
        elif f.type in ("literal_error", "enum"):
            kinds.append(f"one of {f.ctx.get('expected', '')}")
        else:
            rules.append(_rule(f))
    said = [f"must be {_either(list(dict.fromkeys(kinds)))}"] if kinds else []
    return "; ".join(said + list(dict.fromkeys(rules)))


def _rule(f: _Found) -> str:
    if f.type in ("value_error", "assertion_error"):
        return str(f.ctx.get("error", f.msg))
    if f.type in ("string_too_short", "too_short") and f.ctx.get("min_length") == 1:
        return "must not be empty"
    if f.type.startswith("union_tag_") and not f.ctx.get("discriminator", "").startswith("'"):
        return "is of no form this field takes"  # a function tells the forms apart
    if f.type in _RULES:
        try:
            return _RULES[f.type].format(**f.ctx)
        except (KeyError, IndexError):
            pass
    # a type met nowhere above: pydantic's words where they name no type of its own
    words = f.msg.replace("Input should be", "must be")
    return words if _PLAIN.fullmatch(words) else "is not valid"


def _either(kinds: list[str]) -> str:
    """'a string', 'an integer or an array': the literal choices, which hold an 'or' of
    their own, last."""
    kinds = sorted(kinds, key=lambda k: k.startswith("one of "))
    if len(kinds) == 1:
        return kinds[0]
    head, last = ", ".join(kinds[:-1]), kinds[-1]
    return head + (", or " if last.startswith("one of") else " or ") + last
