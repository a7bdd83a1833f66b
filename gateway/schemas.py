"""Request bodies at the HTTP boundary (pydantic), in OpenAI's shapes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# OpenAI's clients send fields this server does not use (e.g. `service_tier`);
# like vLLM, ignore unknown fields rather than refuse them.
_LENIENT = ConfigDict(extra="ignore")


class TextPart(BaseModel):
    model_config = _LENIENT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _LENIENT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported")
            parts.append(part.text)
        return "".join(parts)


class StreamOptions(BaseModel):
    model_config = _LENIENT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and completions, with vLLM's extras."""

    model_config = _LENIENT
    model: str = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: int = -1
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        for m in self.messages:
            m.text()  # refuses unsupported content parts here, as a 400
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if not self.prompts():
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        p: Any = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    rpm: Annotated[int, Field(ge=0)] | None = None
    tpm: Annotated[int, Field(ge=0)] | None = None
    max_concurrent: Annotated[int, Field(ge=0)] | None = None
    daily_tokens: Annotated[int, Field(ge=0)] | None = None
    monthly_tokens: Annotated[int, Field(ge=0)] | None = None
    models: list[str] | None = None
    priority: int = 0
    weight: Annotated[float, Field(gt=0)] = 1.0


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, min_length=1, max_length=200)
    rpm: Annotated[int, Field(ge=0)] | None = None
    tpm: Annotated[int, Field(ge=0)] | None = None
    max_concurrent: Annotated[int, Field(ge=0)] | None = None
    daily_tokens: Annotated[int, Field(ge=0)] | None = None
    monthly_tokens: Annotated[int, Field(ge=0)] | None = None
    models: list[str] | None = None
    priority: int | None = None
    weight: Annotated[float, Field(gt=0)] | None = None


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = ""
    scopes: list[Literal["inference", "admin"]] = ["inference"]
    expires_at: float | None = None
    expires_in_s: Annotated[float, Field(gt=0)] | None = None
