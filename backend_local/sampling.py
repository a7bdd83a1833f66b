"""Per-request sampling: parameters, the llama.cpp sampler chain, and logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import llama_cpp
import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: off; n: the sampled token's logprob and the n best
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def build_sampler(params: SamplingParams, n_vocab: int) -> llama_cpp.llama_sampler_p:
    """A sampler chain for one request; the caller frees it with llama_sampler_free."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = llama_cpp.llama_sampler_chain_add
    if params.has_penalties:
        # OpenAI penalties count the tokens generated so far, not the prompt: the chain
        # only sees tokens it sampled itself.
        add(
            chain,
            llama_cpp.llama_sampler_init_penalties(
                n_vocab,
                params.max_tokens,
                params.repetition_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            ),
        )
    if params.temperature == 0:
        add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1:
        add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0:
        add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
    seed = llama_cpp.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
    add(chain, llama_cpp.llama_sampler_init_dist(seed))
    return chain


def token_logprob(logits: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    """Log-softmax of the model's raw logits (before sampling transforms), as vLLM reports."""
    peak = float(logits.max())
    log_z = peak + math.log(float(np.exp(logits - peak).sum()))
    top: list[tuple[int, float]] = []
    if top_n:
        best = np.argpartition(logits, -top_n)[-top_n:]
        best = best[np.argsort(-logits[best], kind="stable")]
        top = [(int(t), float(logits[t]) - log_z) for t in best]
    return TokenLogprob(token, float(logits[token]) - log_z, top)
