"""Request bodies of the worker's routes, as strict as the gateway's (gateway/schemas.py).

The worker's /v1/completions is the gateway's CompletionRequest narrowed to what one
engine call serves (one prompt, n = 1) plus vLLM's `cache_salt` and `priority`, which a
gateway in front sets per tenant. /kvgate/v1/generate takes any JSON object: the
GenRequest record decodes it, strictly, itself.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, RootModel, field_validator, model_validator

from gateway.schemas import (
    ChatMessage,
    CompletionRequest,
    Name,
    Priority,
    TokenIds,
    _Body,
)


class WorkerCompletionRequest(CompletionRequest):
    # vLLM's: salts the prefix cache (a gateway in front sends the tenant's salt)
    cache_salt: Name | None = None
    # vLLM's: lower runs first
    priority: Priority = 0

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not all(isinstance(x, int) for x in v):
            raise ValueError(
                "a worker serves one prompt per request: a string or a list of token ids"
            )
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("a worker serves n = 1 only")
        return v


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template."""

    model: Name
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if not self.add_generation_prompt:
            raise ValueError("add_generation_prompt must be true: chats are rendered for a reply")
        for m in self.messages or []:
            m.text()  # refuses unsupported content parts here, as a 400
        return self

    def rendered(self) -> str | list[dict[str, str]]:
        """What the adapter's `render` takes, as the gateway passes it."""
        if self.messages is None:
            assert self.prompt is not None
            return self.prompt
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class DetokenizeRequest(_Body):
    model: Name
    tokens: TokenIds


class JsonObject(RootModel[dict[str, Any]]):
    """Any JSON object (a record's `from_dict` checks its fields)."""
