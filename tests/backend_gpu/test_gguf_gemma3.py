"""The real default model: Gemma 3 270M Q4_K_M GGUF, loaded by the engine (dequantized)
and by transformers from the same file, greedy token for token; and, restarted over the
disk tier its first run wrote, the same tokens from the prefix it loads back."""

from __future__ import annotations

import os

import pytest

from backend_gpu import LLM, SamplingParams
from tests.backend_gpu.reference import assert_greedy_matches, hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Paged attention keeps the keys and values of every sequence in fixed-size blocks, so "
    "that memory is allocated on demand and shared between requests that begin alike.",
]
# 16 tokens, not 32: a longer run checks no other path, and each token is the engine's
# and transformers' step over the 262k-token vocabulary on the CPU
TOKENS = 16


@pytest.mark.slow
@pytest.mark.timeout(900)  # a cold start converts the GGUF first (cached afterwards)
def test_gemma3_270m_gguf_greedy_matches_transformers(tmp_path):
    from gateway.backends.default_model import default_model_path

    path = default_model_path()
    # a short max_model_len: the KV budget (a tenth of free memory by default) then holds
    # a sequence whatever else the machine holds
    options = {"max_num_batched_tokens": 64, "max_model_len": 512, "kv_disk_path": str(tmp_path)}
    options["kv_tier_secret"] = "one secret for both engines, as a gateway gives them"
    llm = LLM(path, **options)
    assert type(llm.engine.runner.model).__name__ == "Gemma3ForCausalLM"
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_ids, params)
    directory, name = os.path.split(path)
    refs = hf_greedy(directory, prompt_ids, TOKENS, gguf_file=name)
    for out, (ref_ids, ref_logits) in zip(outs, refs, strict=True):
        assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
    assert outs[0].text.strip()  # real words, detokenized

    llm.engine.close()  # the disk tier's writes done
    del llm
    again = LLM(path, **options)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = again.generate([prompt_ids[-1]], greedy)
    assert out.token_ids == outs[-1].token_ids[:8]
    assert out.num_cached_tokens == (len(prompt_ids[-1]) - 1) // 16 * 16 > 0
    assert again.stats().kv_disk_hits == out.num_cached_tokens
