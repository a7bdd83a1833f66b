"""OpenAI-shaped response bodies as pydantic models, for the OpenAPI document only
(gateway.routes.openapi): errors, completions and their stream chunks, models, tokenize. The
operator-facing ones are in gateway.schemas.responses_admin, on the same `Body`.

The handlers build plain dicts (openai_format, tenants, admin_api, prefix_api); these
classes say what those dicts hold, and the schemathesis run in tests/gateway/test_fuzz.py
checks every response against them, so a field added, dropped or retyped on either side
fails a test. Each forbids extra keys for that reason.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    """Every response body: extra keys are a break of the contract. Validators are built
    when the OpenAPI document first is (defer_build), not at import: no handler validates
    with these, and building them cost every `kvgate serve` start about 0.07 CPU-s."""

    model_config = ConfigDict(extra="forbid", defer_build=True)


class ErrorObject(Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Body):
    """OpenAI's error shape: every 4xx and 5xx carries it."""

    error: ErrorObject


class PromptTokensDetails(Body):
    cached_tokens: int
    image_tokens: int = Field(0, description="of the prompt's tokens, its images'")


class CompletionTokensDetails(Body):
    reasoning_tokens: int = Field(
        description="tokens generated while the output parser read reasoning"
    )


class CompletionUsage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="chat's only"
    )


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Body):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(Body):
    tokens: list[str]
    # null for an echoed prompt's first token: nothing comes before it
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ReplyFunction(Body):
    name: str
    arguments: str = Field(description="JSON text, valid for the function's parameters")


class ReplyToolCall(Body):
    id: str
    type: Literal["function"]
    function: ReplyFunction


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the reply is only tool calls")
    reasoning: str | None = Field(None, description="the reasoning, as its parser read it")
    reasoning_content: str | None = Field(None, description="the same text (older clients)")
    tool_calls: list[ReplyToolCall] | None = None


class ChatChoice(Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class CompletionChoice(Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    system_fingerprint: None


class TextCompletion(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    system_fingerprint: None


class CalledFunctionDelta(Body):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(Body):
    """A call's first delta has its id, type and name, later ones more of its
    arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: CalledFunctionDelta


class ChatDelta(Body):
    # the first chunk of a choice names the role; later ones carry text, the last none
    role: Literal["assistant"] = Field(default="assistant")
    content: str = Field(default="")
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Body):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]


class TextCompletionChunk(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]


class ChatUsageChunk(ChatCompletionChunk):
    """The last event of a stream with `stream_options.include_usage`: no choices."""

    choices: list[ChatChunkChoice] = Field(max_length=0)
    usage: CompletionUsage


class TextUsageChunk(TextCompletionChunk):
    """The last event of a stream with `stream_options.include_usage`: no choices."""

    choices: list[CompletionChoice] = Field(max_length=0)
    usage: CompletionUsage


class ModelParsers(Body):
    """kvgate's: the output parsers that read the model's replies (docs/apis.md)."""

    reasoning_parser: str | None
    tool_call_parser: str | None
    parsers_from: Literal["configured", "detected", "none"]


class ModelCard(Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    task: Literal["generate", "embed"] = Field(
        description="kvgate's: generate (chat, completions) or embed (/v1/embeddings)"
    )
    # an embedding model's only: its vectors' size, and whether `dimensions` may cut them
    embedding_size: int | None = None
    truncatable: bool | None = None
    vision: bool = Field(False, description="kvgate's: the model takes images in chat")
    parent: str | None = Field(None, description="a LoRA adapter's base model (vLLM's)")
    kvgate: ModelParsers | None = None


class ModelList(Body):
    object: Literal["list"]
    data: list[ModelCard]


class Tokens(Body):
    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(Body):
    prompt: str
