"""The Responses API's answers (POST /v1/responses) as pydantic models, for the OpenAPI
document only (gateway.routes.openapi), as gateway.schemas.responses is for the other routes.

The handler builds plain dicts (gateway.serving.responses_events); these say what those
dicts hold, every key, so that a key added or dropped on either side fails the checks
against the document (tests/gateway/test_responses_api.py, test_fuzz.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.schemas.responses import Body

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseOutputText(Body):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseOutputMessage(Body):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[ResponseOutputText]


class ResponseFunctionCall(Body):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ResponseReasoningText(Body):
    type: Literal["reasoning_text"]
    text: str


class ResponseReasoning(Body):
    """The model's reasoning, as its output parser read it (docs/apis.md)."""

    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[ResponseReasoningText]
    encrypted_content: None
    status: ItemStatus


OutputItem = ResponseReasoning | ResponseOutputMessage | ResponseFunctionCall


class ResponseInputTokensDetails(Body):
    cached_tokens: int
    cache_write_tokens: int
    image_tokens: int = Field(0, description="of the input's tokens, its images'")


class ResponseOutputTokensDetails(Body):
    reasoning_tokens: int


class ResponseUsage(Body):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseError(Body):
    code: str
    message: str


class ResponseIncompleteDetails(Body):
    reason: Literal["max_output_tokens"]


class ResponseObject(Body):
    """A Response; the request's fields it repeats are as they were sent."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None
    incomplete_details: ResponseIncompleteDetails | None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    previous_response_id: None
    reasoning: None
    store: Literal[False]
    background: Literal[False]
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    user: str | None


class ResponseLifecycleEvent(Body):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    sequence_number: int
    response: ResponseObject


class ResponseOutputItemEvent(Body):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ResponseContentPartEvent(Body):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ResponseOutputText


class ResponseTextDeltaEvent(Body):
    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class ResponseTextDoneEvent(Body):
    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ResponseArgumentsDeltaEvent(Body):
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ResponseArgumentsDoneEvent(Body):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


class ResponseReasoningDeltaEvent(Body):
    type: Literal["response.reasoning_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ResponseReasoningDoneEvent(Body):
    type: Literal["response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


STREAM_EVENTS = (
    ResponseLifecycleEvent,
    ResponseOutputItemEvent,
    ResponseContentPartEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseArgumentsDeltaEvent,
    ResponseArgumentsDoneEvent,
    ResponseReasoningDeltaEvent,
    ResponseReasoningDoneEvent,
)
