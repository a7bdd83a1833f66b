"""A structured-output constraint: what the output must match, one definition for every
engine (vLLM's `StructuredOutputsParams`, by its names).

The gateway builds it from `response_format`, vLLM's `guided_*` fields and tool calls;
the gpu engine compiles it with a grammar library, the llama.cpp engine into a GBNF
grammar; the wire carries it inside SamplingParams. The bounds are checked here, once,
so no engine compiles a schema larger or deeper than any other would accept. A schema
is carried as JSON text: the wire's records hold scalars and lists, and the text is the
key compiled grammars are cached by.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine_api.errors import BadRequestError
from engine_api.wire import Record, check_types, show

MAX_SCHEMA_CHARS = 64 * 1024  # a schema's JSON text, a grammar's or a pattern's source
MAX_SCHEMA_DEPTH = 32  # nesting of objects and arrays in the schema document itself
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# what may come before the constrained text, where the model's family reasons first
# (gateway.parsers' reasoning parsers): "think", a `<think>...</think>` block or none
# (Qwen3: the model opens it when it thinks); "open_think", reasoning up to `</think>`
# (DeepSeek-R1: the prompt opened `<think>`, so the output starts inside it)
REASONING_FORMS = ("think", "open_think")


@dataclass
class StructuredOutput(Record):
    """Exactly one of: `json` (a JSON schema, as JSON text), `json_object` (any JSON
    object), `regex`, `choice` (one of these strings), `grammar` (GBNF, llama.cpp's
    grammar format); and `reasoning`, one of REASONING_FORMS or None: the reasoning the
    constrained text may follow (it goes out as reasoning, the constraint holds after)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    reasoning: str | None = None

    wire_error = BadRequestError

    @classmethod
    def from_schema(cls, schema: Any) -> StructuredOutput:
        """A JSON schema given as a dict (or a bool) or as JSON text, as compact JSON
        text; BadRequestError if the text is not JSON."""
        if isinstance(schema, str):
            schema = _load(schema)
        # compact, keys in the order given: a schema's properties come out in its order
        return cls(json=json.dumps(schema, separators=(",", ":")))

    @property
    def kind(self) -> str:
        """Which constraint this is (one of KINDS); validate() checks there is one."""
        (kind,) = [k for k in KINDS if getattr(self, k) not in (None, False)]
        return kind

    @property
    def source(self) -> str:
        """The constraint as text: the schema, the pattern, the grammar or the choices
        as a JSON list ("" for json_object); with `kind`, what a compiled grammar is
        cached by."""
        kind = self.kind
        if kind == "choice":
            return json.dumps(self.choice)
        return "" if kind == "json_object" else getattr(self, kind)

    def gbnf(self) -> str:
        """`choice` or `grammar` as a GBNF grammar (its start rule is `root`)."""
        if self.kind == "choice":
            return "root ::= " + " | ".join(_gbnf_literal(c) for c in self.choice or [])
        return self.grammar or ""

    def schema(self) -> Any:
        """The JSON schema this constraint means: `json`'s, or any object for json_object."""
        return {"type": "object"} if self.json_object else json.loads(self.json or "null")

    def validate(self) -> None:
        """Raise BadRequestError naming what is wrong: not exactly one constraint, or one
        past the bounds (size, depth, number of choices)."""
        check_types(self, BadRequestError)
        if self.reasoning not in (None, *REASONING_FORMS):
            raise BadRequestError(
                f"reasoning must be one of {', '.join(REASONING_FORMS)}, got {show(self.reasoning)}"
            )
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise BadRequestError(
                f"a structured output needs exactly one of {', '.join(KINDS)}; got "
                + (", ".join(given) or "none")
            )
        kind = given[0]
        if kind == "choice":
            _check_choices(self.choice or [])
            return
        if kind == "json_object":
            return
        text = self.source
        if not text:
            raise BadRequestError(f"the structured output's {kind} is empty")
        if len(text) > MAX_SCHEMA_CHARS:
            raise BadRequestError(
                f"the structured output's {kind} has {len(text)} characters; "
                f"at most {MAX_SCHEMA_CHARS} are allowed"
            )
        if kind == "json":
            _check_schema(self.json or "")


def _gbnf_literal(text: str) -> str:
    """A GBNF string literal matching exactly `text`."""
    chars = [
        "\\" + c if c in '"\\' else f"\\x{ord(c):02X}" if ord(c) < 0x20 or c == "\x7f" else c
        for c in text
    ]
    return '"' + "".join(chars) + '"'


def _check_choices(choices: list[str]) -> None:
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise BadRequestError(f"choice must hold 1 to {MAX_CHOICES} strings, got {len(choices)}")
    for c in choices:
        if not 1 <= len(c) <= MAX_CHOICE_CHARS:
            raise BadRequestError(
                f"each choice must have 1 to {MAX_CHOICE_CHARS} characters, got {show(c)}"
            )


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadRequestError(f"the JSON schema is not valid JSON: {exc}") from None


def _check_schema(text: str) -> None:
    schema = _load(text)
    if not isinstance(schema, dict | bool):
        raise BadRequestError(f"a JSON schema must be an object or a boolean, got {show(schema)}")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise BadRequestError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")


def _depth(value: Any) -> int:
    """Nesting of objects and arrays, without recursion (a hostile schema is deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            if level > MAX_SCHEMA_DEPTH:
                break
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, level + 1) for child in children)
    return deepest
