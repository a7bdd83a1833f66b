"""The Backend protocol: the only way the gateway reaches an inference engine.

Backends (`backend_gpu`, `backend_local`) never import `gateway`; each one has an
adapter in this package that serves this protocol with its own API. The records and
errors the protocol speaks are engine_api's, shared with the engines themselves.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engine_api.records import (
    AdapterRef,
    BackendStats,
    EmbedRequest,
    EmbedResult,
    GenChunk,
    GenRequest,
    KVEvent,
    ModelCard,
    Progress,
    PromptInput,
)
from engine_api.structured import StructuredOutput


@dataclass
class ParsedChunk(GenChunk):
    """A chunk of an upstream that read its model's output itself (vLLM's and SGLang's
    reasoning and tool-call parsers): its reasoning and its OpenAI-shaped tool-call deltas
    apart from its text. They pass through (gateway.serving.parsed_output)."""

    reasoning: str = ""
    tool_calls: list[dict[str, Any]] | None = None

    def parsed_text(self) -> str:
        """What the meter counts beside the text: the reasoning and the calls' JSON."""
        calls = self.tool_calls or []
        return self.reasoning + "".join(
            str(c.get("function", {}).get("name") or "")
            + str(c.get("function", {}).get("arguments") or "")
            for c in calls
        )


# Requests a backend behind the gateway's fair queue takes beyond its `max_in_flight`
# (gateway/routing/fair_queue.py): a seat for a tenant becoming active, as the gpu
# engine keeps one beyond max_num_seqs (backend_gpu/scheduler.py).
SPARE_SEATS = 1


@runtime_checkable
class Backend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self, drain: bool = True) -> None: ...

    def models(self) -> list[ModelCard]: ...

    async def render(
        self, model: str, prompt: PromptInput, tools: list[dict] | None = None
    ) -> list[int]:
        """Chat messages (with `tools`, through the model's chat template) or a prompt
        -> token ids. A message's content may be a list of parts, {"type": "text",
        "text": str} and {"type": "image", "image": ImageInput}: a backend whose model
        takes images (ModelCard.vision) writes each image's placeholder tokens where it
        stands, in order (GenRequest.images carries the pixels in the same order); any
        other raises BadRequestError("model X does not take images") (common.refuse_images)."""
        ...

    async def detokenize(
        self, model: str, token_ids: list[int], skip_special_tokens: bool = False
    ) -> str:
        """Token ids -> text, with the model's tokenizer (/detokenize): special tokens (a
        chat's turn markers, BOS) as their text unless `skip_special_tokens`;
        BadRequestError for an id outside its vocabulary."""
        ...

    async def check_structured(self, model: str, structured: StructuredOutput) -> None:
        """Compile `structured` (the engine caches it for the request to come), or raise
        BadRequestError naming what cannot be compiled or is not supported here."""
        ...

    def generate(
        self, req: GenRequest, progress: Progress | None = None
    ) -> AsyncIterator[GenChunk]:
        """Stream the request's output. Closing the iterator early aborts the request
        in the engine and frees its KV blocks. `progress` hears how much of the prompt
        was computed, and holds all of it once the iterator is closed (the step in
        flight included): what a request cut short is billed for."""
        ...

    def stats(self) -> BackendStats: ...


@runtime_checkable
class PrefixCachingBackend(Backend, Protocol):
    """A backend (one replica) that reports its prefix cache to the gateway's catalog."""

    def block_hashes(
        self,
        token_ids: list[int],
        cache_salt: str | None,
        shared_prefix_len: int = 0,
        adapter: AdapterRef | None = None,
    ) -> list[str]:
        """Hex chain hashes of the prompt's full blocks, as this backend keys its cache
        (under a LoRA adapter: from its chain root, engine_api.block_hash.adapter_root).
        A backend whose model takes images also takes `images=` (GenRequest.images): their
        placeholders' blocks keyed by their digests, as its engine keys them."""
        ...

    def kv_events(self) -> list[KVEvent]:
        """Drain the events since the last call (never blocks)."""
        ...


@runtime_checkable
class LoraBackend(Backend, Protocol):
    """A backend that serves LoRA adapters over its base model: a request whose
    `GenRequest.adapter` is set runs under that adapter (loaded on demand), and its stats'
    `extra["adapters_loaded"]` names the adapters resident now (the router prefers those)."""

    async def check_adapter(self, ref: AdapterRef) -> None:
        """Raise BadRequestError naming what is wrong with the adapter for this replica's
        model (no such path, another base model's shapes, a rank above the limit, an
        unknown target module, LoRA not enabled); return if it would serve."""
        ...

    async def remove_adapter(self, name: str) -> None:
        """Forget the adapter (its requests in flight have finished)."""
        ...


@runtime_checkable
class OutputCountingBackend(Backend, Protocol):
    """A backend whose chunks may carry text without token ids (a third-party upstream):
    the gateway counts that text's tokens with this when the request ends."""

    @property
    def text_bound(self) -> bool:
        """Whether its prompts are text-bound (gateway.backends.remote_text): the ids
        `render` gives are the prompt's bytes, an upper bound, not tokens."""
        ...

    async def count_prompt(self, model: str, token_ids: list[int]) -> int | None:
        """The tokens of a text-bound prompt by the upstream's own tokenizer, where it can
        count them exactly (a string prompt); None where it cannot (a chat, rendered by a
        template the upstream keeps to itself, or no tokenizer endpoint)."""
        ...

    async def count_output(self, model: str, text: str, local_only: bool) -> int | None:
        """Tokens in generated `text` by the model's tokenizer; None where none can count
        it (or, with `local_only`, where only the upstream itself could)."""
        ...


@runtime_checkable
class ChatTemplateBackend(Backend, Protocol):
    """A backend that renders chats with a template it holds (the in-process engines):
    it says what the gateway's output parsers are detected from, and renders with the
    request's template variables (vLLM's chat_template_kwargs, Qwen3's enable_thinking)."""

    def chat_template_info(self) -> tuple[str | None, list[str], str | None]:
        """(the chat template, the model's architectures, its model_type), as
        gateway.parsers.detect takes them."""
        ...

    async def render_chat(
        self, model: str, prompt: PromptInput, tools: list[dict] | None, kwargs: dict
    ) -> list[int]:
        """`render`, with `kwargs` as the template's variables."""
        ...


@runtime_checkable
class EmbeddingBackend(Backend, Protocol):
    """A backend that serves embedding models (the ones whose ModelCard.task is EMBED)."""

    async def embed(self, req: EmbedRequest, progress: Progress | None = None) -> EmbedResult:
        """The inputs' vectors, pooled and normalized as the model says; BadRequestError
        for an input it cannot take (too long, `dimensions` it does not support).
        `progress` hears the tokens of the inputs pooled, all of them once a cancelled
        call has returned."""
        ...
