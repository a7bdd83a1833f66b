"""Greedy outputs equal transformers' token for token on tiny random models, whatever
the engine's batching does: chunked prefill, prefix caching, preemption, sliding window."""

from __future__ import annotations

import random

import pytest

from backend_gpu import LLM, SamplingParams
from tests.backend_gpu.reference import assert_greedy_matches, hf_greedy
from tests.backend_gpu.tiny_models import VOCAB

MAX_NEW = 12
_references: dict[str, list] = {}


def mixed_prompts() -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(4, VOCAB) for _ in range(40)]
    prompts = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (3, 17, 33, 50, 70)]
    # two prompts with a common 40-token prefix, so prefix caching has something to share
    prompts += [shared + [5, 6, 7], shared + [8, 9]]
    return prompts


def reference(model_dir: str) -> list:
    if model_dir not in _references:
        _references[model_dir] = hf_greedy(model_dir, mixed_prompts(), MAX_NEW)
    return _references[model_dir]


def check(llm: LLM, model_dir: str) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(mixed_prompts(), params)
    for out, (ref_ids, ref_logits) in zip(outs, reference(model_dir), strict=True):
        assert out.finish_reason == "length"
        assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
    return outs


SETTINGS = {
    "chunked+prefix": dict(max_num_batched_tokens=24),
    "whole-prefill,no-prefix-cache": dict(
        enable_chunked_prefill=False, enable_prefix_caching=False, max_num_batched_tokens=128
    ),
    "one-seq-at-a-time": dict(max_num_seqs=1),
}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(tiny_model_dir, arch, setting):
    model_dir = tiny_model_dir(arch)
    llm = LLM(model_dir, **SETTINGS[setting])
    if arch == "gemma3":  # prompts run past the sliding window of its local layers
        assert llm.engine.hf_config.sliding_window == 16
        assert max(len(p) for p in mixed_prompts()) > 4 * 16
    check(llm, model_dir)
    outs = check(llm, model_dir)  # again: now the prompts' full blocks are cached
    stats = llm.stats()
    if llm.engine.config.enable_prefix_caching:
        assert stats.prefix_hits > 0 and outs[-1].num_cached_tokens >= 32
    else:
        assert stats.prefix_hits == 0 and all(o.num_cached_tokens == 0 for o in outs)
    assert stats.num_free_blocks == stats.num_blocks


def test_qwen2_with_qkv_bias_matches_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    llm = LLM(model_dir, max_num_batched_tokens=24)
    assert llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.bias is not None
    check(llm, model_dir)


def preempting_llm(model_dir: str) -> LLM:
    """An engine whose pool holds 8 blocks of 16 tokens: the longest request of
    mixed_prompts (70 + 12 tokens) fits, the whole batch does not, so some are preempted."""
    probe = LLM(model_dir, kv_cache_memory_bytes=1 << 20)
    block_bytes = probe.stats().kv_cache_bytes // probe.stats().num_blocks
    return LLM(
        model_dir,
        kv_cache_memory_bytes=8 * block_bytes,
        max_num_batched_tokens=32,
        max_model_len=8 * 16,  # what the pool holds: a smaller pool is refused
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_matches_under_preemption(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    llm = preempting_llm(model_dir)
    assert llm.stats().num_blocks == 8
    check(llm, model_dir)
    stats = llm.stats()
    assert stats.preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks
