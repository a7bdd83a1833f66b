"""Per-request sampling with llama.cpp: the sampler chain for engine_api's SamplingParams
(validated before a request reaches the worker), and logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from engine_api.sampling import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def build_sampler(params: SamplingParams, n_vocab: int) -> llama_cpp.llama_sampler_p | None:
    """A sampler chain for one request, which the caller frees with llama_sampler_free; None
    for plain greedy decoding, which needs no chain: the worker takes the row's argmax
    (llama.cpp's sampler would first copy all n_vocab logits into a candidate array)."""
    if params.temperature == 0 and not params.has_penalties:
        return None
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


def logit_bias_arrays(params: SamplingParams) -> tuple[np.ndarray, np.ndarray] | None:
    """(token ids, biases) for the worker to add to each logits row in place, where both
    the argmax of plain greedy and llama.cpp's chain read it; None without a bias. The
    ids are distinct (SamplingParams.validate), so one fancy-indexed add is right."""
    if not params.logit_bias:
        return None
    ids, biases = zip(*params.logit_bias, strict=True)
    return np.array(ids, dtype=np.intp), np.array(biases, dtype=np.float32)


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
