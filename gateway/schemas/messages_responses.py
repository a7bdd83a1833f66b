"""Anthropic-shaped response bodies of /v1/messages and /v1/messages/count_tokens as
pydantic models, for the OpenAPI document only (gateway.routes.openapi), as
gateway.schemas.responses is for OpenAI's: the handlers (gateway.routes.messages,
gateway.serving.messages_stream) build plain dicts, and the schemathesis run checks
every response against these. Each forbids extra keys.
"""

from __future__ import annotations

from typing import Any, Literal

from gateway.schemas.responses import Body


class AnthropicErrorObject(Body):
    type: str
    message: str


class AnthropicError(Body):
    """Anthropic's error shape: every 4xx and 5xx of the Messages routes carries it, and
    an `error` event ends a stream that fails after its 200."""

    type: Literal["error"]
    error: AnthropicErrorObject


class MessageUsage(Body):
    input_tokens: int  # the prompt's tokens that were not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    image_tokens: int | None = None  # kvgate's: of the prompt's tokens, its images'


class ReplyText(Body):
    type: Literal["text"]
    text: str


class ReplyThinking(Body):
    """The model's reasoning, as its output parser read it; `signature` is a digest of
    the text (kvgate checks none it is sent back)."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class ReplyToolUse(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageReply(Body):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ReplyThinking | ReplyText | ReplyToolUse]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class MessageTokens(Body):
    input_tokens: int


class MessageStart(Body):
    type: Literal["message_start"]
    message: MessageReply


class Ping(Body):
    type: Literal["ping"]


class ContentBlockStart(Body):
    type: Literal["content_block_start"]
    index: int
    content_block: ReplyThinking | ReplyText | ReplyToolUse


class TextDelta(Body):
    type: Literal["text_delta"]
    text: str


class InputJsonDelta(Body):
    type: Literal["input_json_delta"]
    partial_json: str


class ThinkingDelta(Body):
    type: Literal["thinking_delta"]
    thinking: str


class SignatureDelta(Body):
    type: Literal["signature_delta"]
    signature: str


class ContentBlockDelta(Body):
    type: Literal["content_block_delta"]
    index: int
    delta: ThinkingDelta | SignatureDelta | TextDelta | InputJsonDelta


class ContentBlockStop(Body):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(Body):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None


class MessageDelta(Body):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: MessageUsage


class MessageStop(Body):
    type: Literal["message_stop"]


STREAM_EVENTS = (
    MessageStart,
    Ping,
    ContentBlockStart,
    ContentBlockDelta,
    ContentBlockStop,
    MessageDelta,
    MessageStop,
    AnthropicError,
)
