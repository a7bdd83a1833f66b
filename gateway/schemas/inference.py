"""Inference request bodies at the HTTP boundary (pydantic), in OpenAI's and vLLM's shapes:
chat completions, completions and their sampling fields, /tokenize and /detokenize.

Types are strict (`"stream": "yes"` is not a boolean, `Infinity` is not a number) and
every value is bounded (gateway.schemas.fields); a list is as long as OpenAI allows. A
field kvgate does not implement is refused with a 400 that names it rather than ignored.
/openapi.json is generated from these same models. The management bodies (tenants, keys,
pins) are gateway.schemas.admin's.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from engine_api.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    check_ends,
)
from engine_api.structured import StructuredOutput
from gateway.schemas.base import NO_CONTROL
from gateway.schemas.base import StrictBody as _Body
from gateway.schemas.content import ContentPart, has_image, message_content
from gateway.schemas.fields import INT32, INT53, Count32, IntIn, Name, Priority, TokenId
from gateway.schemas.structured import (
    GUIDED,
    MAX_TOOLS,
    JsonSchema,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    ToolCall,
    ToolCallId,
    ToolSpec,
    checked,
)

MAX_CHOICES = 128  # prompts x n, as OpenAI caps n
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_TOKEN_IDS = 64
MAX_MOCK_RESPONSE = 1 << 20  # characters of a mock_response


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: ToolCallId | None = None
    # a reply's reasoning sent back with it (the SDKs send a reply's message as it came):
    # to the template as reasoning_content, which Qwen3's renders in a tool loop's turns
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls are only allowed on assistant messages")
        if (self.reasoning or self.reasoning_content) is not None and self.role != "assistant":
            raise ValueError("reasoning is only allowed on assistant messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        if self.role != "user" and has_image(self.content):
            raise ValueError("image_url parts are only allowed in user messages")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template takes it (gateway.backends.tool_prompt writes tool fields
        where the template has none)."""
        out: dict[str, Any] = {"role": self.role, "content": message_content(self.content)}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        if thought := self.reasoning_content or self.reasoning:
            out["reasoning_content"] = thought
        return out


class StreamOptions(_Body):
    include_usage: bool = False


_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")


class SamplingFields(_Body):
    """Fields shared by chat and completions, with vLLM's extras."""

    model: Name
    max_tokens: Annotated[int, IntIn(1, INT32)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, IntIn(-1, INT32)] = -1
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    n: Annotated[int, IntIn(1, MAX_CHOICES)] = 1
    stop: (
        Annotated[str, Field(min_length=1, max_length=1000)]
        | Annotated[
            list[Annotated[str, Field(min_length=1, max_length=1000)]],
            Field(max_length=MAX_STOP),
        ]
        | None
    ) = None
    # seed + choice index seeds each choice; llama.cpp keeps 32 bits of it
    seed: Annotated[int, IntIn(-INT53, INT53)] | None = None
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0
    min_tokens: Count32 = 0
    ignore_eos: bool = False
    # vLLM's: False keeps special tokens in the text (the output parsers' markers keep
    # them by themselves: gateway.serving.sampling.keep_markers)
    skip_special_tokens: bool = True
    stop_token_ids: Annotated[list[Count32], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # OpenAI's: {"token id": bias}, the bias in [-100, 100] added to the token's logit
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
            Field(max_length=MAX_LOGIT_BIAS_TOKENS),
        ]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=200, pattern=NO_CONTROL)] | None = None
    # structured outputs: OpenAI's response_format, or vLLM's fields; at most one
    response_format: ResponseFormat | None = None
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # LiteLLM's: the text the fake backend "generates" (testing without a model); any
    # other backend refuses the request (gateway.serving.admission)
    mock_response: Annotated[str, Field(max_length=MAX_MOCK_RESPONSE)] | None = None
    # vLLM's: the request's scheduling class, lower first; a request may only yield, never
    # go ahead of its tenant's own priority (gateway.serving.admission takes the larger)
    priority: Priority | None = None

    @field_validator(*GUIDED)
    @classmethod
    def _guided(cls, v: Any, info: Any) -> Any:
        if v is not None:
            checked(GUIDED[info.field_name](v))
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        given = [n for n in (*GUIDED, "structured_outputs") if getattr(self, n) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"send at most one structured output; got {', '.join(given)}")
        if given:
            check_ends(self.min_tokens, self.ignore_eos)
        return self

    def structured(self) -> StructuredOutput | None:
        """What the output must match, from whichever field asked for it."""
        if self.response_format is not None and (out := self.response_format.structured()):
            return out
        if self.structured_outputs is not None:
            return self.structured_outputs.structured()
        for name, make in GUIDED.items():
            if (value := getattr(self, name)) is not None:
                return make(value)
        return None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        return [v] if isinstance(v, str) else v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        # one spelling per id ("05" would bias 5 twice): no leading zeros, at most 10 digits
        bad = [k for k in (v or {}) if not (_TOKEN_ID.fullmatch(k) and int(k) <= INT32)]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids in [0, {INT32}], got {bad[0]!r}")
        return v

    def token_bias(self) -> list[tuple[int, float]]:
        """logit_bias as the engines take it: (token id, bias) pairs."""
        return [(int(k), v) for k, v in (self.logit_bias or {}).items()]

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, IntIn(1, INT32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, IntIn(0, MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: extra variables for the chat template (Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if self.forced_tools:
            if self.structured() is not None:
                raise ValueError(
                    "a required or named tool_choice cannot be combined with a structured output"
                )
            check_ends(self.min_tokens, self.ignore_eos)

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named: what tool calls the reply may or must make."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def thinking(self) -> bool:
        """Whether the reply may reason: `enable_thinking: false` turns it off."""
        return (self.chat_template_kwargs or {}).get("enable_thinking") is not False

    @property
    def forced_tools(self) -> bool:
        return self.tool_mode in ("required", "named")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return None  # chat has no echo


TokenIds = list[TokenId]


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_CHOICES)]
        | TokenIds
        | Annotated[list[TokenIds], Field(max_length=MAX_CHOICES)]
    )
    logprobs: Annotated[int, IntIn(0, MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        prompts = self.prompts()
        if not prompts:
            raise ValueError("prompt must not be empty")
        if len(prompts) * self.n > MAX_CHOICES:
            raise ValueError(
                f"{len(prompts)} prompts x n={self.n} asks for {len(prompts) * self.n} "
                f"choices; at most {MAX_CHOICES} are allowed per request"
            )
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

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The prompt's logprobs come back with its echo (gateway.serving.echo)."""
        return self.logprobs if self.echo else None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template, made
    into the token ids a completion of it would be given."""

    model: Name
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    # vLLM's: the chat template's variables (Qwen3's enable_thinking), as on a chat
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if not self.add_generation_prompt:
            raise ValueError("add_generation_prompt must be true: chats are rendered for a reply")
        if not self.add_special_tokens:
            raise ValueError(
                "add_special_tokens must be true: prompts are tokenized as a completion gets them"
            )
        return self

    def rendered(self) -> str | list[dict[str, Any]]:
        """What the adapter's `render` takes, as the gateway passes it."""
        if self.messages is None:
            assert self.prompt is not None
            return self.prompt
        return [m.as_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template, as the gateway passes them."""
        return [t.model_dump(exclude_none=True) for t in self.tools or []] or None


class DetokenizeRequest(_Body):
    """vLLM's /detokenize: token ids back to text, special tokens (a chat's turn markers)
    included as vLLM's are, unless `skip_special_tokens` (kvgate's, the sampling field's
    name) leaves them out."""

    model: Name
    tokens: TokenIds
    skip_special_tokens: bool = False
