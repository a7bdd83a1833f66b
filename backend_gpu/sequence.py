"""One request's state inside the engine: its tokens, its KV blocks, how far it got."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from engine_api.block_hash import adapter_root
from engine_api.records import GenRequest, Progress

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from backend_gpu.multimodal import ImagePrompt


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Sequence:
    _arrival = itertools.count()

    def __init__(self, req: GenRequest) -> None:
        """A sequence for `req` (its prompt must be token ids: the engine tokenizes text
        before it builds the request)."""
        assert 0 <= req.shared_prefix_len <= len(req.prompt_token_ids)
        self.request_id = req.request_id
        self.arrival = next(Sequence._arrival)
        self.token_ids = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.params = req.sampling
        self.cache_salt = req.cache_salt
        # leading prompt tokens that are a published prefix: hashed without the salt
        self.shared_prefix_len = req.shared_prefix_len
        # its LoRA adapter (None: the base model); its blocks' hash chain starts at the
        # adapter's root, so no other adapter's (or the base model's) blocks serve it
        self.adapter = req.adapter
        self.hash_root = adapter_root(req.adapter)
        self.lora_slot = -1  # the adapter's device slot while running (backend_gpu.lora)
        self.priority = req.priority
        # fair share (backend_gpu.fairness): whose service this is, and its weight
        self.tenant_id = req.tenant_id
        self.weight = float(req.weight)
        self.prompt_charged = False
        self.num_outputs_charged = 0
        self.status = SequenceStatus.WAITING
        # KV of token_ids[:num_computed_tokens] is in the cache; the scheduler moves it
        # towards len(token_ids), whatever mix of prefill and decode that takes.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hashes of the full blocks, in order
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[Logprob] = []
        # params.prompt_logprobs: prompt tokens 1.. scored by the positions before them,
        # in order, each once (backend_gpu.prompt_logprobs records them)
        self.prompt_logprobs: list[Logprob] = []
        self.num_preemptions = 0
        # proposed next tokens, not yet checked by the target model (never in token_ids):
        # the scheduler verifies them with the next decode, or drops them
        self.spec_token_ids: list[int] = []
        # a structured output's matcher (backend_gpu.guided): where its grammar is now
        self.grammar: LLMatcher | None = None
        # where its caller reads how much of the prompt is computed (None: nobody does)
        self.progress: Progress | None = None
        # its images' placeholders and M-RoPE positions (None: a text prompt); the engine
        # sets it at admission (backend_gpu.multimodal)
        self.images: ImagePrompt | None = None

    @property
    def key_spans(self) -> list[tuple[int, int, bytes]] | None:
        """Its images' token spans, hashed into its blocks (None: no images)."""
        return self.images.key_spans if self.images is not None else None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_logprobs_pending(self) -> bool:
        """It asked for prompt logprobs and some are not recorded yet: its prompt
        positions from there on must be computed, not taken from the prefix cache."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority, then arrival."""
        return (self.priority, self.arrival)
