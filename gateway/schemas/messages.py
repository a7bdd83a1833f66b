"""Anthropic Messages API request bodies at the HTTP boundary (pydantic): /v1/messages
and /v1/messages/count_tokens, and their translation into the chat completion a Job
serves.

The Messages API is served on the chat-completions machinery, so that every backend
(the engines and remote upstreams alike) serves it with no code of its own: `chat_body`
turns a body into the ChatCompletionRequest it means (tool_result blocks become tool
messages, tool_use blocks an assistant's tool calls, `tool_choice` any/tool/none the
required/named/none modes, `thinking: {"type": "disabled"}` enable_thinking false, and
an assistant's thinking blocks are left out, a user's image blocks OpenAI's image_url
parts: base64 as a data: URL, a `url` source as the URL, which the gateway fetches only
from allowed hosts). Strict like every body: an unknown field, and a content block
kvgate does not implement (document, ...), is a 400 that names it. `cache_control` is
accepted and ignored: kvgate's prefix cache is automatic.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from engine_api.structured import StructuredOutput
from gateway.schemas.base import NO_CONTROL, Refused
from gateway.schemas.base import StrictBody as _Body
from gateway.schemas.content import image_part
from gateway.schemas.fields import INT32, IntIn, Name
from gateway.schemas.inference import MAX_MOCK_RESPONSE, MAX_STOP, ChatCompletionRequest
from gateway.schemas.structured import (
    MAX_TOOLS,
    Description,
    FunctionName,
    ToolCallId,
    checked,
)

BLOCKS = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
# the image types Anthropic's API takes in a base64 source
MediaType = Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
StopSequence = Annotated[str, Field(min_length=1, max_length=1000)]


class CacheControl(_Body):
    """Accepted and ignored: kvgate caches every prompt's prefix blocks on its own."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class Base64Source(_Body):
    type: Literal["base64"]
    media_type: MediaType
    data: Annotated[str, Field(min_length=1)]


class UrlSource(_Body):
    type: Literal["url"]
    url: Annotated[str, Field(min_length=1)]


class ImageBlock(_Body):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def as_part(self) -> dict[str, Any]:
        """The image as an OpenAI image_url part."""
        s = self.source
        url = s.url if isinstance(s, UrlSource) else f"data:{s.media_type};base64,{s.data}"
        return image_part(url)


class ToolUseBlock(_Body):
    """A call the assistant made, in the history."""

    type: Literal["tool_use"]
    id: ToolCallId
    name: FunctionName
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: ToolCallId
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else _joined(self.content)
        return "Error: " + text if self.is_error else text


class ThinkingBlock(_Body):
    """An assistant's reasoning sent back as it was received: taken and left out of the
    prompt, as chat templates leave earlier turns' reasoning out (its signature is not
    checked: kvgate signs nothing)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str
    cache_control: CacheControl | None = None


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, v: Any) -> Any:
        """A block type kvgate does not take is named, rather than pydantic's union error."""
        for i, block in enumerate(v if isinstance(v, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCKS:
                raise Refused(
                    f"content blocks of type {kind[:100]!r} are not supported; "
                    f"kvgate takes {', '.join(BLOCKS)}",
                    i,
                    "type",
                )
        return v

    @model_validator(mode="after")
    def _check_roles(self) -> Message:
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        if self.role == "user" and kinds & {"tool_use", "thinking", "redacted_thinking"}:
            raise ValueError("tool_use and thinking blocks belong in assistant messages")
        if self.role == "assistant" and kinds & {"tool_result", "image"}:
            raise ValueError("tool_result and image blocks belong in user messages")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """The message as OpenAI chat messages: a user's tool results each a tool
        message (before its text, as Anthropic asks them to come first), an assistant's
        tool_use blocks its tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        texts = [b.text for b in self.content if isinstance(b, TextBlock)]
        if self.role == "assistant":
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in self.content
                if isinstance(b, ToolUseBlock)
            ]
            out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            return [out | {"tool_calls": calls}] if calls else [out]
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            for b in self.content
            if isinstance(b, ToolResultBlock)
        ]
        if any(isinstance(b, ImageBlock) for b in self.content):
            parts = [
                b.as_part() if isinstance(b, ImageBlock) else {"type": "text", "text": b.text}
                for b in self.content
                if isinstance(b, TextBlock | ImageBlock)
            ]
            return [*results, {"role": "user", "content": parts}]
        return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


class Tool(_Body):
    name: FunctionName
    description: Description | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools are not kvgate's
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        checked(StructuredOutput.from_schema(v))
        return v


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _check(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type 'tool' needs a name, and only it has one")
        if self.type == "none" and self.disable_parallel_tool_use:
            raise ValueError("disable_parallel_tool_use does not apply to tool_choice 'none'")
        return self

    def as_openai(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class ThinkingConfig(_Body):
    """Anthropic's extended thinking: "disabled" turns a reasoning model's thinking off
    (as chat_template_kwargs' enable_thinking false); the budget is not enforced."""

    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, IntIn(1024, INT32)] | None = None

    @model_validator(mode="after")
    def _check(self) -> ThinkingConfig:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("thinking of type 'enabled' needs budget_tokens, and only it has one")
        return self


class Metadata(_Body):
    user_id: Annotated[str, Field(max_length=200, pattern=NO_CONTROL)] | None = None


class CountTokensRequest(_Body):
    """/v1/messages/count_tokens: what the prompt of these messages would count."""

    model: Name
    messages: list[Message] = Field(min_length=1)
    system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None  # the whole prompt's; ignored as a block's is
    # the chat completion the body means, made while it is validated: a body the chat
    # rules refuse is a 400 like any other
    _chat: ChatCompletionRequest | None = PrivateAttr(default=None)

    @property
    def chat(self) -> ChatCompletionRequest:
        assert self._chat is not None
        return self._chat

    @model_validator(mode="after")
    def _check_turns(self) -> CountTokensRequest:
        if self.messages[-1].role == "assistant":
            raise ValueError(
                "the last message must be the user's: kvgate does not continue a prefilled "
                "assistant message"
            )
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: names must be unique")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice {choice.type!r} needs tools")
        if choice is not None and choice.name is not None and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        self._chat = _chat_request(self.chat_fields() | self.sampling_fields())
        return self

    def sampling_fields(self) -> dict[str, Any]:
        return {}

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion fields these messages, system and tools make."""
        messages = [] if self.system is None else [{"role": "system", "content": self.system_text}]
        for m in self.messages:
            messages += m.chat_messages()
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
        if self.tool_choice is not None and (self.tools or self.tool_choice.type == "none"):
            fields["tool_choice"] = self.tool_choice.as_openai()
            if self.tool_choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return fields

    @property
    def system_text(self) -> str:
        return self.system if isinstance(self.system, str) else _joined(self.system or [])


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, IntIn(1, INT32)]
    stop_sequences: Annotated[list[StopSequence], Field(max_length=MAX_STOP)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, IntIn(1, INT32)] | None = None
    metadata: Metadata | None = None
    stream: bool = False
    mock_response: Annotated[str, Field(max_length=MAX_MOCK_RESPONSE)] | None = None  # LiteLLM's
    thinking: ThinkingConfig | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """The chat completion fields of the sampling options."""
        fields: dict[str, Any] = {"max_tokens": self.max_tokens}
        if "temperature" in self.model_fields_set:  # else the model's default, then 1.0
            fields["temperature"] = self.temperature
        optional = {
            "stop": self.stop_sequences,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "user": self.metadata.user_id if self.metadata else None,
            "mock_response": self.mock_response,
        }
        fields["stream"] = self.stream
        if self.thinking is not None and self.thinking.type == "disabled":
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        return fields | {k: v for k, v in optional.items() if v is not None}


def _chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat completion of these fields; a ValueError (the body's 400) for one the
    chat rules refuse."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise ValueError(
            "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
        ) from None


def _joined(blocks: list[TextBlock]) -> str:
    return "".join(b.text for b in blocks)
