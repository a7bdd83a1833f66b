"""What an engine consumes and produces, as plain records the gateway, both backends and
the wire to a worker process share: a generation request, its output chunks, their
usage and logprobs, how much of a request's input was computed (Progress), prefix-cache
events, the model card and the replica's stats.

The ones that cross to a worker process are `Record`s: `to_dict` / `from_dict` carry them
as JSON objects and refuse unknown or mistyped fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine_api.errors import BadRequestError
from engine_api.images import ImageInput
from engine_api.sampling import SamplingParams
from engine_api.wire import Record

# A chat is a list of {"role": ..., "content": str}; a completion prompt is a
# string or a list of token ids. A message's content may instead be a list of parts,
# {"type": "text", "text": str} and {"type": "image", "image": ImageInput}, in order: how
# every API's images reach a backend's render (one that takes no images refuses them).
Messages = list[dict[str, Any]]
PromptInput = str | list[int] | Messages


@dataclass
class AdapterRef(Record):
    """A LoRA adapter a request runs under: its name (unique in a gateway) and its files:
    a PEFT directory (adapter_config.json + adapter_model.safetensors) for backend_gpu, a
    GGUF LoRA file for backend_local."""

    name: str
    path: str

    wire_error = BadRequestError


@dataclass
class GenRequest(Record):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    tenant_id: str = ""
    cache_salt: str | None = None
    priority: int = 0
    # leading prompt tokens that are an admin-published prefix: their full blocks are
    # cached without the tenant's salt, so every tenant shares them (on purpose)
    shared_prefix_len: int = 0
    # the tenant's fair-share weight (its quota's): a scheduler that shares by tenant
    # serves it in proportion; the gpu engine refuses one that is not > 0
    weight: float = 1.0
    # disaggregated prefill: the base URL of a prefill worker that computed this
    # prompt's blocks; a decode worker pulls them from there first (None: compute here)
    kv_source: str | None = None
    # the LoRA adapter this request runs under (None: the base model); its blocks are
    # hashed under the adapter's own chain root (block_hash.adapter_root)
    adapter: AdapterRef | None = None
    # LiteLLM's mock_response: the text to "generate" instead of sampling; only the fake
    # backend takes it (tests of parsers, clients and APIs without a model)
    mock_response: str | None = None
    # the prompt's images in the order their placeholders appear in prompt_token_ids
    images: list[ImageInput] = field(default_factory=list)

    wire_error = BadRequestError

    def to_dict(self) -> dict[str, Any]:
        """As Record's, each image in its own wire form (its file, not its pixels)."""
        if not self.images:
            return super().to_dict()
        out = dataclasses.replace(self, images=[]).to_dict()
        out["images"] = [image.to_dict() for image in self.images]
        return out


class Progress:
    """How much of one request's input an engine has computed, for a caller that must know
    after it stopped reading the request's stream: the gateway bills a request cut short
    (a client that hung up during prefill) by what was computed, since that work stays in
    the prefix cache for the next request to hit. For a generation: its prompt tokens
    whose KV is computed, the prefix-cache hits among them as `cached`; for an embedding
    request: the tokens of its inputs pooled so far.

    The engine writes it from its own thread, once per prefill chunk or batch of inputs
    (never per output token), only ever upward: a preempted prompt computed again is not
    counted twice. Each write is one assignment, so a reader on another thread never sees
    half of one; an engine that aborts a request on its caller's behalf returns from the
    abort only once its last write is done."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts = (0, 0)  # (tokens, cached)

    def advance(self, tokens: int, cached: int = 0) -> None:
        if tokens > self._counts[0]:
            self._counts = (tokens, min(cached, tokens))

    @property
    def tokens(self) -> int:
        return self._counts[0]

    @property
    def cached(self) -> int:
        return self._counts[1]


@dataclass
class TokenLogprob(Record):
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Usage(Record):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # "engine": the engine counted; "gateway": a remote upstream sent no usage, so the
    # gateway counted with the model's tokenizer (the usage row says which)
    counted_by: str = "engine"
    # of prompt_tokens, how many are images' placeholder tokens (the engine counts them)
    image_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class GenChunk(Record):
    """One step of a request's output. The last chunk has finish_reason and usage set."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    # the first chunk of a request with SamplingParams.prompt_logprobs: one per prompt
    # token, None for the first (nothing comes before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # the last chunk of a request a stop string ended (finish_reason "stop"): that string
    # (Anthropic's stop_sequence); None for an end of sequence or a stop token
    stop_sequence: str | None = None


# KVEvent.medium: a replica's KV cache, and the tiers under it that it loads back from
KV_MEDIA = ("device", "lower")


@dataclass
class KVEvent(Record):
    """A change in which prompt blocks one replica holds in its prefix cache.

    kind: "stored" (the block's KV is computed and findable) or "removed" (evicted).
    block_hash: hex of the backend's chain hash, the same value `block_hashes` returns.
    cache_salt: the salt the block was hashed with; None for a published (shared) block.
    medium: where in the replica: "device" (its KV cache) or "lower" (its own tiers below
    it, host memory or disk: loaded back on a hit, not computed). A block may be in both,
    and a "removed" event says from which. A store shared by replicas sends none.
    """

    kind: str
    replica: str
    block_hash: str
    parent_hash: str | None
    cache_salt: str | None
    num_tokens: int
    at: float
    medium: str = "device"


@dataclass
class EmbedRequest(Record):
    """Token ids of one or more inputs to embed with an embedding model. The vectors come
    back pooled and normalized as the model's own configuration says (for a
    sentence-transformers model, its modules.json), truncated to `dimensions` and then
    normalized again where that is asked and the model supports it."""

    request_id: str
    model: str
    inputs: list[list[int]]
    tenant_id: str = ""
    dimensions: int | None = None
    # the inputs as the client sent them, where all were text: a third-party upstream
    # that cannot take token ids (llama-cpp-python's server) is sent these instead
    texts: list[str] | None = None

    wire_error = BadRequestError


@dataclass
class EmbedResult(Record):
    embeddings: list[list[float]]
    prompt_tokens: int


# ModelCard.task: what a model does; a request of the other kind is a 400 naming it
GENERATE, EMBED = "generate", "embed"


@dataclass
class ModelCard:
    id: str
    backend: str
    context_length: int
    owned_by: str = "kvgate"
    task: str = GENERATE  # GENERATE or EMBED
    # an embedding model's vector size, and whether `dimensions` may shorten it
    # (a Matryoshka-trained model's, as its configuration says)
    embedding_size: int | None = None
    truncatable: bool = False
    # what a request that leaves a sampling option out is sampled with (temperature,
    # top_p, top_k, min_p, repetition_penalty): the model's own advice
    # (gateway.backends.generation_config); an option not here takes the API's default
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # the model takes images in chat messages (a vision-language model whose backend
    # can encode them); every other model refuses them with a 400
    vision: bool = False


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
