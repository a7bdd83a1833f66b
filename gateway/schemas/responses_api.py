"""OpenAI's Responses API request body (POST /v1/responses) at the HTTP boundary, and its
translation into the chat completion request every backend already serves.

A translation rather than a second pipeline: rendering, structured outputs, forced tool
calls, quotas, placement and metering are the chat path's, so the Responses API works
on every backend and is billed by the same rules. kvgate keeps no state between
requests, so what needs a stored response (`store`, `previous_response_id`,
`conversation`, `background`, item references) and the built-in tools OpenAI runs on its
own side are refused by name rather than ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from engine_api.structured import StructuredOutput
from gateway.schemas.base import NO_CONTROL, Refused
from gateway.schemas.base import StrictBody as _Body
from gateway.schemas.content import image_part
from gateway.schemas.fields import INT32, IntIn, Name
from gateway.schemas.inference import MAX_MOCK_RESPONSE, ChatCompletionRequest
from gateway.schemas.structured import (
    MAX_TOOLS,
    Description,
    FunctionName,
    FunctionSpec,
    JsonSchema,
    ToolCallId,
    checked,
)

STATELESS = (
    "kvgate's Responses API is stateless: it stores no responses and no conversations, "
    "so send the whole conversation in `input`"
)
# OpenAI's request fields that only a stored response can serve: refused, named
STATEFUL_FIELDS = ("previous_response_id", "conversation")
ItemId = Annotated[str, Field(max_length=200, pattern=NO_CONTROL)]
MAX_METADATA = 16  # OpenAI's limits on metadata: pairs, key and value lengths
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


PARTS = ("input_text", "output_text", "input_image")


class ResponseContentPart(_Body):
    """A part of a message of `input`: `input_text` (user, system, developer),
    `output_text` (an assistant turn sent back, with its annotations and logprobs), or a
    user's `input_image` (its `image_url`: a data: URL, or a URL the gateway fetches only
    from allowed hosts; `detail` accepted; an uploaded file's `file_id` is not taken)."""

    type: Literal["input_text", "output_text", "input_image"]
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    image_url: Annotated[str, Field(min_length=1)] | None = None
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # not an object: pydantic says so
        kind = data.get("type")
        if kind not in PARTS:
            raise Refused(
                f"content parts of type {kind!r} are not supported: kvgate takes "
                f"{', '.join(PARTS)}",
                "type",
            )
        if kind == "input_image" and data.get("file_id") is not None:
            raise Refused(
                "input_image by file_id is not supported: send image_url (a data: URL)",
                "file_id",
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponseContentPart:
        image = self.type == "input_image"
        if image and (self.image_url is None or self.text is not None):
            raise ValueError("an input_image part has image_url, and no text")
        if not image and (self.text is None or self.image_url or self.detail):
            raise ValueError(f"a {self.type} part has text, and no image_url")
        return self


def _text_or_list(v: Any) -> str:
    return "text" if isinstance(v, str) else "list"


# a string, or a list: told apart first, so that an error in one speaks of that one only
Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ResponseContentPart], Tag("list")],
    Discriminator(_text_or_list),
]


def _text(content: Content) -> str:
    if isinstance(content, str):
        return content
    if any(p.type == "input_image" for p in content):
        raise ValueError("input_image parts belong in user messages")
    return "".join(p.text or "" for p in content)


def _chat_content(content: Content) -> str | list[dict[str, Any]]:
    """A user message's content for the chat: its text, or with images OpenAI's parts."""
    if isinstance(content, str) or all(p.type != "input_image" for p in content):
        return _text(content)
    return [
        image_part(p.image_url)  # type: ignore[arg-type]
        if p.type == "input_image"
        else {"type": "text", "text": p.text}
        for p in content
    ]


class ResponseInputMessage(_Body):
    """A turn of the conversation; `id` and `status` come with an output message sent
    back as it was received."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponseFunctionCallInput(_Body):
    """A function call the model made, sent back with its output."""

    type: Literal["function_call"]
    call_id: ToolCallId
    name: FunctionName
    arguments: str
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponseFunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: ToolCallId
    output: Content
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponseReasoningInput(_Body):
    """A reasoning item a Response gave, sent back with the turn it led to: taken and left
    out of the prompt (chat templates leave earlier turns' reasoning out too)."""

    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list, max_length=1000)
    content: list[dict[str, Any]] | None = Field(None, max_length=1000)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(item: Any) -> Any:
    """An item's type; a message may leave it out. Whatever was sent, so that one of no
    known type is named as it is."""
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return "message" if kind is None else kind


InputItem = Annotated[
    Annotated[ResponseInputMessage, Tag("message")]
    | Annotated[ResponseFunctionCallInput, Tag("function_call")]
    | Annotated[ResponseFunctionCallOutput, Tag("function_call_output")]
    | Annotated[ResponseReasoningInput, Tag("reasoning")],
    Discriminator(_item_type),
]


class ResponseFunctionTool(FunctionSpec):
    """A tool of type function, flat as the Responses API writes it."""

    type: Literal["function"]


class ResponseToolChoiceFunction(_Body):
    type: Literal["function"]
    name: FunctionName


class ResponseTextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    description: Description | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseTextFormat:
        schema_fields = (self.name, self.schema_, self.description, self.strict)
        if self.type == "json_schema":
            if self.name is None or self.schema_ is None:
                raise ValueError("a json_schema format needs name and schema")
            checked(StructuredOutput.from_schema(self.schema_))
        elif any(f is not None for f in schema_fields):
            raise ValueError("name, schema, description and strict go with type json_schema")
        return self

    def response_format(self) -> dict[str, Any]:
        """The chat completion's `response_format` for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "description": self.description}
        spec["strict"] = self.strict
        return {
            "type": "json_schema",
            "json_schema": {k: v for k, v in spec.items() if v is not None},
        }


class ResponseTextConfig(_Body):
    format: ResponseTextFormat | None = None


class ResponseCreateRequest(_Body):
    """POST /v1/responses, stateless: the conversation is all in `input`."""

    model: Name
    input: Annotated[
        Annotated[str, Field(min_length=1), Tag("text")]
        | Annotated[list[InputItem], Field(min_length=1, max_length=100_000), Tag("list")],
        Discriminator(_text_or_list),
    ]
    instructions: str | None = None
    tools: Annotated[list[ResponseFunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: ResponseTextConfig | None = None
    max_output_tokens: Annotated[int, IntIn(1, INT32)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    stream: bool = False
    user: Annotated[str, Field(max_length=200, pattern=NO_CONTROL)] | None = None
    mock_response: Annotated[str, Field(max_length=MAX_MOCK_RESPONSE)] | None = None  # LiteLLM's
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)] | None = (
        None
    )
    store: Literal[False] = Field(False, description="Must be false: " + STATELESS + ".")
    background: Literal[False] = Field(False, description="Must be false: answers are not kept.")
    truncation: Literal["disabled"] = "disabled"  # "auto" would drop input: not done
    _chat: ChatCompletionRequest | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _refuse_state(cls, data: Any) -> Any:
        """The fields and values only a stored response could serve, named (before the
        strict body's generic 'unrecognized' would); fields sent as null dropped."""
        if not isinstance(data, dict):
            return data
        # null asks for the default (OpenAI's schema has most fields nullable)
        data = {k: v for k, v in data.items() if v is not None}
        for name in STATEFUL_FIELDS:
            if data.get(name) is not None:
                raise ValueError(f"{name!r} is not supported: {STATELESS}.")
        if data.get("store") is True:
            raise ValueError(f"'store': true is not supported: {STATELESS}; send false or omit it.")
        if data.get("background") is True:
            raise ValueError("'background': true is not supported: responses are not kept.")
        return data

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v: Any) -> Any:
        for i, tool in enumerate(v if isinstance(v, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else "function"
            if kind != "function":  # (one that is no object: pydantic says so)
                raise Refused(
                    f"tools of type {kind!r} are not supported: kvgate runs none of OpenAI's "
                    "built-in tools; send tools of type 'function'",
                    i,
                    "type",
                )
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise Refused(
                f"tool_choice of type {v.get('type')!r} is not supported: choose 'none', "
                "'auto', 'required' or {'type': 'function', 'name': ...}",
                "type",
            )
        return v

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, v: Any) -> Any:
        for i, item in enumerate(v if isinstance(v, list) else []):
            kind = _item_type(item)
            if kind == "item_reference":
                raise Refused(
                    f"input items of type 'item_reference' are not supported: {STATELESS}",
                    i,
                    "type",
                )
            if kind not in ("message", "function_call", "function_call_output", "reasoning"):
                raise Refused(
                    f"input items of type {kind!r} are not supported: send messages, "
                    "function_call, function_call_output and reasoning items",
                    i,
                    "type",
                )
        return v

    @model_validator(mode="after")
    def _as_chat(self) -> ResponseCreateRequest:
        """Translated here, so that what the chat body refuses (a tool_choice naming no
        tool, a forced tool with a JSON format) is this body's 400 too."""
        body = {
            "model": self.model,
            "messages": self._messages(),
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "user": self.user,
            "mock_response": self.mock_response,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tools": [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools or []
            ]
            or None,
            "tool_choice": self._chat_tool_choice(),
        }
        for unset in {"temperature", "top_p"} - self.model_fields_set:
            del body[unset]  # the model's default, then the API's
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        try:
            self._chat = ChatCompletionRequest.model_validate(body, strict=False)
        except ValidationError as e:
            raise ValueError(
                "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
            ) from None
        return self

    def chat(self) -> ChatCompletionRequest:
        """The chat completion request this body asks for."""
        assert self._chat is not None
        return self._chat

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, ResponseToolChoiceFunction):
            return {"type": "function", "function": {"name": choice.name}}
        return choice

    def _messages(self) -> list[dict[str, Any]]:
        """`instructions` as the system message, then the items as chat messages: function
        calls join the assistant turn before them, their outputs are tool messages."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        names: dict[str, str] = {}  # call_id -> the function called, for its output
        for item in self.input:
            if isinstance(item, ResponseInputMessage):
                content = _chat_content(item.content) if item.role == "user" else None
                messages.append({"role": item.role, "content": content or _text(item.content)})
            elif isinstance(item, ResponseFunctionCallInput):
                names[item.call_id] = item.name
                call = {"id": item.call_id, "type": "function"}
                call["function"] = {"name": item.name, "arguments": item.arguments}
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": None, "tool_calls": []}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
            elif isinstance(item, ResponseFunctionCallOutput):
                tool = {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
                if item.call_id in names:
                    tool["name"] = names[item.call_id]
                messages.append(tool)
        return messages

    def echoed(self) -> dict[str, Any]:
        """The request's fields a Response repeats back."""
        fmt = self.text.format if self.text is not None and self.text.format else None
        choice = self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": self.temperature,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt
                else {"type": "text"}
            },
            "tool_choice": choice.model_dump()
            if isinstance(choice, ResponseToolChoiceFunction)
            else choice or "auto",
            "tools": [t.model_dump() for t in self.tools or []],
            "top_p": self.top_p,
            "truncation": self.truncation,
            "user": self.user,
        }
