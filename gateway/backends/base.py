"""The Backend protocol: the only way the gateway reaches an inference engine.

Backends (`backend_gpu`, `backend_local`) never import `gateway`; each one has an
adapter in this package that translates between these records and its own API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# A chat is a list of {"role": ..., "content": str}; a completion prompt is a
# string or a list of token ids.
Messages = list[dict[str, Any]]
PromptInput = str | list[int] | Messages


class BackendError(Exception):
    """The backend cannot serve right now (down, overloaded, crashed): HTTP 503."""


class BadRequestError(ValueError):
    """The request can never be served as sent (prompt too long, empty...): HTTP 400."""


class PromptTooLongError(BadRequestError):
    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length
        super().__init__(
            f"This model's maximum context length is {context_length} tokens, "
            f"but the prompt has {prompt_tokens} tokens"
            + (f" and {max_tokens} were requested for the completion" if max_tokens else "")
            + "."
        )


@dataclass
class SamplingOptions:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: off; n >= 0: the sampled token plus n alternatives
    ignore_eos: bool = False


@dataclass
class GenRequest:
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    tenant_id: str = ""
    cache_salt: str | None = None
    priority: int = 0
    # leading prompt tokens that are an admin-published prefix: their full blocks are
    # cached without the tenant's salt, so every tenant shares them (on purpose)
    shared_prefix_len: int = 0


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class GenChunk:
    """One step of a request's output. The last chunk has finish_reason and usage set."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class KVEvent:
    """A change in which prompt blocks one replica holds in its prefix cache.

    kind: "stored" (the block's KV is computed and findable) or "removed" (evicted).
    block_hash: hex of the backend's chain hash, the same value `block_hashes` returns.
    cache_salt: the salt the block was hashed with; None for a published (shared) block.
    """

    kind: str
    replica: str
    block_hash: str
    parent_hash: str | None
    cache_salt: str | None
    num_tokens: int
    at: float


@dataclass
class ModelCard:
    id: str
    backend: str
    context_length: int
    owned_by: str = "kvgate"


@dataclass
class BackendStats:
    name: str
    healthy: bool = True
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of the KV pool in use, 0..1
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found
    preemptions: int = 0
    prompt_tokens_per_s: float = 0.0
    gen_tokens_per_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self, drain: bool = True) -> None: ...

    def models(self) -> list[ModelCard]: ...

    async def render(self, model: str, prompt: PromptInput) -> list[int]:
        """Chat messages (through the model's chat template) or a prompt -> token ids."""
        ...

    def generate(self, req: GenRequest) -> AsyncIterator[GenChunk]:
        """Stream the request's output. Closing the iterator early aborts the request
        in the engine and frees its KV blocks."""
        ...

    def stats(self) -> BackendStats: ...


@runtime_checkable
class PrefixCachingBackend(Backend, Protocol):
    """A backend (one replica) that reports its prefix cache to the gateway's catalog."""

    def block_hashes(
        self, token_ids: list[int], cache_salt: str | None, shared_prefix_len: int = 0
    ) -> list[str]:
        """Hex chain hashes of the prompt's full blocks, as this backend keys its cache."""
        ...

    def kv_events(self) -> list[KVEvent]:
        """Drain the events since the last call (never blocks)."""
        ...
