"""Tool calls on chat: which calls a reply may make (`tool_choice`), the constraint that
makes a forced call parse, and the calls read back out of the reply's text.

- named (`tool_choice` names a function): the reply is that function's arguments,
  constrained to its parameters' JSON schema.
- required: the reply is a JSON array of `{"name", "parameters"}` objects, constrained
  to the tools' schemas (vLLM's form), at least one (exactly one without
  `parallel_tool_calls`).
- auto: the model is free; its family's output parser (gateway.parsers, chosen per backend:
  gateway.serving.parser_choice) reads its calls out of the text, `hermes` where none is
  chosen (the `<tool_call>` blocks gateway.backends.tool_prompt asks for).

The plan also says whether the reply may reason first: not where the request turned
thinking off (`chat_template_kwargs: {"enable_thinking": false}`); where its text is
constrained (a forced call, a structured output), only in a family whose reasoning is a
`<think>` block (`think_first`): the grammar then lets that block come before the
constrained text (engine_api.grammar), and the block goes out as reasoning.
A reply whose calls parse ends with finish_reason "tool_calls" (gateway.serving.parsed_output).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine_api.structured import StructuredOutput
from gateway.parsers.text import new_call_id
from gateway.schemas.inference import ChatCompletionRequest
from gateway.schemas.structured import NamedToolChoice

NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str = "none"  # none | auto | required | named
    schemas: dict[str, Any] = field(default_factory=dict)  # function name -> parameters
    named: str | None = None
    parallel: bool = True
    thinking: bool = True  # chat_template_kwargs' enable_thinking
    constrained: bool = False  # a grammar holds the text from its first token

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolPlan:
        schemas = {t.function.name: t.function.parameters for t in body.tools or []}
        choice = body.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        constrained = body.forced_tools or body.structured() is not None
        return cls(
            body.tool_mode, schemas, named, body.parallel_tool_calls, body.thinking, constrained
        )

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

    def forced(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A required call's whole reply: its content (the text itself where it is not
        the JSON array, cut short by max_tokens) and its calls, OpenAI-shaped."""
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        return None, [tool_call(i["name"], json.dumps(i["parameters"])) for i in items]


# the reasoning parsers whose reasoning a grammar lets come first (StructuredOutput.reasoning):
# Qwen3 opens its <think> itself when it thinks; DeepSeek-R1's prompt opened it
THINK_FIRST = {"qwen3": "think", "deepseek_r1": "open_think"}


def think_first(reasoning: str | None, thinking: bool) -> str | None:
    """The reasoning a constrained reply starts with (one of engine_api.structured's
    REASONING_FORMS), for a backend whose reasoning parser is `reasoning`; None where
    there is none (no reasoning parser, harmony's channels, thinking turned off)."""
    return THINK_FIRST.get(reasoning or "") if thinking else None


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
