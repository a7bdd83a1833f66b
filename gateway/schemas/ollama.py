"""Ollama's native API request bodies at the HTTP boundary (pydantic): /api/chat,
/api/generate, /api/embed, /api/embeddings and /api/show, and their translation into
the OpenAI-shaped requests kvgate serves.

Ollama's API is served on the same machinery as /v1/messages: `chat` is the
ChatCompletionRequest (or, for a raw /api/generate, the CompletionRequest) the body
means, made while it is validated, so that a body the chat rules refuse is a 400 like
any other. `options` map onto the sampling fields (num_predict is max_tokens,
repeat_penalty repetition_penalty; num_ctx is accepted up to the model's context and
changes nothing, as the context is the engine's); `format` is a structured output,
`think` the template's enable_thinking, a message's (or /api/generate's) `images`
(base64, as Ollama's clients send files) OpenAI's image_url parts before its text. An
Ollama model name's `:latest` tag is the served model itself. Strict like every body:
an option or field kvgate does not implement (mirostat, template, context, ...) is a
400 that names it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from gateway.config_check import keep_alive_s
from gateway.schemas.base import StrictBody as _Body
from gateway.schemas.content import image_part
from gateway.schemas.embeddings import EmbeddingRequest
from gateway.schemas.fields import INT32, INT53, IntIn, Name
from gateway.schemas.inference import MAX_STOP, ChatCompletionRequest, CompletionRequest
from gateway.schemas.structured import MAX_TOOLS, FunctionName, ToolSpec

LATEST = ":latest"
DEFAULT = "default"  # no keep_alive sent: the gateway's (gateway.ondemand)
M = TypeVar("M", bound=BaseModel)
Stop = Annotated[str, Field(min_length=1, max_length=1000)]
# a message's images, base64 (the count is bounded again by max_images_per_request)
Images = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=64)]


def _with_images(text: str, images: list[str] | None) -> str | list[dict[str, Any]]:
    """A user message's content: its text, or its images (as data: URLs) then its text."""
    if not images:
        return text
    urls = [i if i.startswith("data:") else f"data:;base64,{i}" for i in images]
    return [*(image_part(u) for u in urls), {"type": "text", "text": text}]


def _keep_alive(value: float | str) -> float | str:
    """Ollama's keep_alive as seconds (float), or "forever" (a negative one)."""
    seconds = keep_alive_s(value)
    return "forever" if seconds is None else seconds


# how long the model stays loaded after the request: seconds, or a duration ("10m",
# "1h30m"); 0 unloads it once the request is done, a negative one keeps it
KeepAlive = Annotated[float | str, AfterValidator(_keep_alive)]


def held_for(keep_alive: float | str | None) -> float | str | None:
    """A parsed keep_alive as gateway.ondemand takes it: seconds, None for forever,
    DEFAULT where none was sent."""
    if keep_alive is None:
        return DEFAULT
    return None if keep_alive == "forever" else keep_alive


def served_name(model: str) -> str:
    """The served model an Ollama name means: `smollm2:latest` is `smollm2`."""
    return model.removesuffix(LATEST)


class OllamaOptions(_Body):
    """The runtime options kvgate maps; the rest of Ollama's (mirostat, num_keep, the
    loader's num_gpu, use_mmap, ...) are refused by name."""

    num_predict: Annotated[int, IntIn(-2, INT32)] | None = None  # -1 and -2: no limit
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Annotated[int, IntIn(-INT53, INT53)] | None = None
    stop: Annotated[list[Stop], Field(max_length=MAX_STOP)] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: Annotated[int, IntIn(1, INT32)] | None = None  # checked against the model's

    def sampling_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "repetition_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        if self.num_predict is not None and self.num_predict > 0:
            fields["max_tokens"] = self.num_predict
        return {k: v for k, v in fields.items() if v is not None}


class OllamaCalledFunction(_Body):
    name: FunctionName
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None  # Ollama numbers a reply's calls; ignored in the history


class OllamaToolCall(_Body):
    function: OllamaCalledFunction


class OllamaMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # an assistant's reasoning sent back: to the template
    tool_calls: Annotated[list[OllamaToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_name: FunctionName | None = None
    images: Images | None = None


class _Generating(_Body):
    """What /api/chat and /api/generate share."""

    model: Name
    stream: bool = True  # Ollama streams unless told not to
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    think: bool | None = None
    keep_alive: KeepAlive | None = None
    _request: ChatCompletionRequest | CompletionRequest | None = PrivateAttr(default=None)

    @property
    def request(self) -> ChatCompletionRequest | CompletionRequest:
        assert self._request is not None
        return self._request

    @property
    def num_ctx(self) -> int | None:
        return None if self.options is None else self.options.num_ctx

    def common_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"model": served_name(self.model), "stream": self.stream}
        fields |= self.options.sampling_fields() if self.options else {}
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            schema = {"name": "format", "schema": self.format}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.think is False:
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        return fields


class OllamaChatRequest(_Generating):
    messages: list[OllamaMessage] = Field(default_factory=list)  # none: "load the model"
    tools: Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS)] | None = None

    @model_validator(mode="after")
    def _translate(self) -> OllamaChatRequest:
        if self.load_only:  # answered without generating, as /api/generate's empty prompt
            return self
        fields = self.common_fields() | {"messages": _chat_messages(self.messages)}
        if self.tools:
            fields["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        self._request = validated(ChatCompletionRequest, fields)
        return self

    @property
    def load_only(self) -> bool:
        return not self.messages


class OllamaGenerateRequest(_Generating):
    """/api/generate: the prompt through the model's chat template (as Ollama renders it,
    with `system`), or with `raw` the prompt as it is, a plain completion."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: Images | None = None

    @model_validator(mode="after")
    def _translate(self) -> OllamaGenerateRequest:
        if self.suffix:
            raise ValueError("suffix (fill in the middle) is not supported")
        if not self.prompt:  # Ollama's "load the model": answered without generating
            return self
        fields = self.common_fields()
        if self.raw:
            if self.system is not None:
                raise ValueError("system does not apply to a raw prompt: put it in the prompt")
            if self.images:
                raise ValueError("images need the chat template: they do not go with raw")
            fields.pop("chat_template_kwargs", None)
            self._request = validated(CompletionRequest, fields | {"prompt": self.prompt})
            return self
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": _with_images(self.prompt, self.images)})
        self._request = validated(ChatCompletionRequest, fields | {"messages": messages})
        return self

    @property
    def load_only(self) -> bool:
        return not self.prompt


class OllamaEmbedRequest(_Body):
    """/api/embed: one input or many. `truncate` is accepted, but kvgate never cuts an
    input: one longer than the context is a 400 whatever it says."""

    model: Name
    input: str | list[str]
    truncate: bool = True
    dimensions: Annotated[int, IntIn(1, INT32)] | None = None
    options: OllamaOptions | None = None  # accepted: an embedding samples nothing
    keep_alive: KeepAlive | None = None
    _request: EmbeddingRequest | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _translate(self) -> OllamaEmbedRequest:
        fields: dict[str, Any] = {"model": served_name(self.model), "input": self.input}
        if self.dimensions is not None:
            fields["dimensions"] = self.dimensions
        self._request = validated(EmbeddingRequest, fields)
        return self

    @property
    def request(self) -> EmbeddingRequest:
        assert self._request is not None
        return self._request


class OllamaEmbeddingsRequest(_Body):
    """The older /api/embeddings: one prompt, one vector."""

    model: Name
    prompt: str = Field(min_length=1)
    options: OllamaOptions | None = None
    keep_alive: KeepAlive | None = None

    @property
    def request(self) -> EmbeddingRequest:
        return validated(EmbeddingRequest, {"model": served_name(self.model), "input": self.prompt})


class NamedModel(_Body):
    """A body naming one model as `model`, or as the older `name`."""

    model: Name | None = None
    name: Name | None = None  # the older spelling

    @model_validator(mode="after")
    def _one(self) -> NamedModel:
        if (self.model is None) == (self.name is None):
            raise ValueError("send model (or the older name), exactly one")
        return self

    @property
    def served(self) -> str:
        return served_name(self.model or self.name or "")


class OllamaShowRequest(NamedModel):
    verbose: bool = False


def validated(model: type[M], fields: dict[str, Any]) -> M:
    """The OpenAI-shaped request of these fields; a ValueError (the body's 400) naming
    what its rules refuse."""
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise ValueError(
            "; ".join(_said(err) for err in e.errors()).removeprefix("Value error, ")
        ) from None


def _said(err: Any) -> str:
    where = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def _chat_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """OpenAI chat messages: an assistant's calls get ids, and each tool message the id
    of the earliest unanswered call of its tool_name (or the earliest unanswered call)."""
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (call id, function name)
    for m in messages:
        if m.images and m.role != "user":
            raise ValueError("images belong in user messages")
        msg: dict[str, Any] = {"role": m.role, "content": _with_images(m.content, m.images)}
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for c in m.tool_calls:
                call_id = f"call_{len(out)}_{len(calls)}"
                unanswered.append((call_id, c.function.name))
                arguments = json.dumps(c.function.arguments)
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": arguments},
                    }
                )
            msg["tool_calls"] = calls
        if m.thinking and m.role == "assistant":
            msg["reasoning_content"] = m.thinking
        if m.role == "tool":
            match = [u for u in unanswered if m.tool_name in (None, u[1])]
            if not match:
                raise ValueError("a tool message answers no call of an earlier assistant message")
            unanswered.remove(match[0])
            msg["tool_call_id"] = match[0][0]
            msg["name"] = match[0][1]
        out.append(msg)
    return out
