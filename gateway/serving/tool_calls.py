"""Tool calls on chat: which calls a reply may make (`tool_choice`), the constraint that
makes a forced call parse, and the calls read back out of the reply's text.

- named (`tool_choice` names a function): the reply is that function's arguments,
  constrained to its parameters' JSON schema.
- required: the reply is a JSON array of `{"name", "parameters"}` objects, constrained
  to the tools' schemas (vLLM's form), at least one (exactly one without
  `parallel_tool_calls`).
- auto: the model is free; `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks in its reply (the format gateway.backends.tool_prompt asks for, and Hermes' and Qwen's
  templates use) are calls, the rest is content.

A reply whose calls parse ends with finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from engine_api.structured import StructuredOutput
from gateway.schemas.inference import ChatCompletionRequest
from gateway.schemas.structured import NamedToolChoice

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str = "none"  # none | auto | required | named
    schemas: dict[str, Any] = field(default_factory=dict)  # function name -> parameters
    named: str | None = None
    parallel: bool = True

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolPlan:
        schemas = {t.function.name: t.function.parameters for t in body.tools or []}
        choice = body.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return cls(body.tool_mode, schemas, named, body.parallel_tool_calls)

    def constraint(self) -> StructuredOutput | None:
        """The JSON schema a forced call's text must match; None when the model is free."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutput.from_schema(self.schemas[self.named] or NO_ARGUMENTS)
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema or NO_ARGUMENTS},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in self.schemas.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutput.from_schema(array)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The reply's content (None if it is only calls) and its calls, OpenAI-shaped."""
        if self.mode == "named":
            assert self.named is not None
            return None, [tool_call(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut short (finish_reason "length")
            return None, [tool_call(i["name"], json.dumps(i["parameters"])) for i in items]
        if self.mode == "auto" and OPEN in text:
            return self._parse_blocks(text)
        return text, []

    def _parse_blocks(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        calls = []
        for raw in _blocks(text):
            try:
                obj = json.loads(raw)
            except ValueError:
                return text, []  # not a call after all: all of it is content
            if not isinstance(obj, dict) or obj.get("name") not in self.schemas:
                return text, []
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(
                tool_call(obj["name"], args if isinstance(args, str) else json.dumps(args))
            )
        content = text[: text.index(OPEN)].strip()
        return content or None, calls


def _blocks(text: str) -> list[str]:
    """What each OPEN ... CLOSE block holds (the last may run to the end unclosed),
    found with str.find: a regular expression's lazy match costs a step in Python's
    engine per character, which on a long call stalls the event loop."""
    found, start = [], text.find(OPEN)
    while start != -1:
        start += len(OPEN)
        end = text.find(CLOSE, start)
        found.append(text[start : len(text) if end == -1 else end].strip())
        start = -1 if end == -1 else text.find(OPEN, end + len(CLOSE))
    return found


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": "call_" + os.urandom(12).hex(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ToolCallStream:
    """One streamed choice under a tool plan: what to send now as content and as
    `delta.tool_calls`. A named call streams its arguments as they come; required and
    auto calls are sent whole at the end, auto's content streams until a call starts."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        # text not sent yet: a call, or what may be the start of one; kept in parts and
        # joined once at the end, so that holding a long call costs linear time
        self.held: list[str] = []
        self.held_chars = 0  # a call's worth of them: finish parses it off the loop
        self.calling = False  # auto: a call has begun, the rest is held
        self.call_id: str | None = None

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        plan = self.plan
        if plan.mode == "named":
            assert plan.named is not None
            if self.call_id is None:
                call = tool_call(plan.named, text)
                self.call_id = call["id"]
                return "", [{"index": 0, **call}]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        if plan.mode == "required" or self.calling:
            self.held.append(text)
            self.held_chars += len(text)
            return "", []
        if plan.mode != "auto":
            return text, []
        # before a call, at most a partial OPEN is held: this scan stays short
        pending = "".join(self.held) + text
        if OPEN in pending:
            self.calling, self.held, self.held_chars = True, [pending], len(pending)
            return "", []
        keep = _partial_open(pending)  # may be the first characters of OPEN
        self.held = [pending[len(pending) - keep :]] if keep else []
        return pending[: len(pending) - keep], []

    def finish(self, reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """The rest to send with the last chunk, and its finish_reason."""
        if self.plan.mode == "named":
            return "", [], "tool_calls" if reason == "stop" else reason
        held = "".join(self.held)
        content, calls = self.plan.parse(held) if held else ("", [])
        deltas = [{"index": i, **c} for i, c in enumerate(calls)]
        return content or "", deltas, "tool_calls" if calls and reason == "stop" else reason


def _partial_open(text: str) -> int:
    """How many of the last characters of `text` are a proper prefix of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
