"""Request fields for structured outputs and tools (pydantic, at the HTTP boundary):
`response_format`, vLLM's `guided_*` and `structured_outputs`, `tools`, `tool_choice`
and the tool calls of an assistant message in the history.

Each constraint is built into engine_api's StructuredOutput and checked by its one
`validate()` (bounds on size and depth), so the boundary refuses what every engine would.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from engine_api.structured import StructuredOutput
from gateway.schemas.base import NO_CONTROL
from gateway.schemas.base import StrictBody as _Body

MAX_TOOLS = 128
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # OpenAI's rule for function names


FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME)]
Description = Annotated[str, Field(max_length=4096)]
ToolCallId = Annotated[str, Field(min_length=1, max_length=200, pattern=NO_CONTROL)]


class CalledFunction(_Body):
    name: FunctionName
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Body):
    """A call an assistant message of the history made."""

    id: ToolCallId
    type: Literal["function"]
    function: CalledFunction


JsonSchema = dict[str, Any] | bool


class JsonSchemaFormat(_Body):
    name: FunctionName
    description: Description | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        checked(self.structured())
        return self

    def structured(self) -> StructuredOutput | None:
        if self.json_schema is not None:
            return StructuredOutput.from_schema(self.json_schema.schema_)
        return StructuredOutput(json_object=True) if self.type == "json_object" else None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: JsonSchema | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputs:
        checked(self.structured())
        return self

    def structured(self) -> StructuredOutput:
        out = StructuredOutput(None, bool(self.json_object), self.regex, self.choice, self.grammar)
        if self.json_ is not None:
            out.json = StructuredOutput.from_schema(self.json_).json
        return out


def checked(structured: StructuredOutput | None) -> StructuredOutput | None:
    """engine_api's one validate(), its BadRequestError as pydantic's ValueError."""
    if structured is not None:
        structured.validate()
    return structured


# vLLM's fields for a structured output, and how each becomes one
GUIDED = {
    "guided_json": StructuredOutput.from_schema,
    "guided_regex": lambda v: StructuredOutput(regex=v),
    "guided_choice": lambda v: StructuredOutput(choice=v),
    "guided_grammar": lambda v: StructuredOutput(grammar=v),
}


class FunctionSpec(_Body):
    name: FunctionName
    description: Description | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            checked(StructuredOutput.from_schema(v))
        return v


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class FunctionChoice(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionChoice
