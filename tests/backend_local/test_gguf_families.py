"""The llama.cpp backend serves Qwen2-MoE, Phi-3 (partial rotary, LongRoPE) and Gemma 3 as
published (its multimodal checkpoint's text model) from GGUF files that gguf-py writes
from tiny random checkpoints (gguf_families.py): greedy output equal to transformers'
from the checkpoint itself, token for token up to a near-tie."""

from __future__ import annotations

import pytest

from backend_local import EngineConfig, LocalEngine, SamplingParams
from tests.backend_gpu.reference import hf_greedy
from tests.backend_gpu.test_correctness import mixed_prompts
from tests.backend_local.gguf_families import FAMILIES, save_family, write_gguf
from tests.backend_local.helpers import NEAR_TIE_NATS, collect

MAX_NEW = 12
ARCHITECTURE = {"qwen2_moe": "qwen2moe", "phi3": "phi3", "gemma3_mm": "gemma3"}


def prompts(family: str) -> list[list[int]]:
    """Phi-3's longer than its 32 original positions: llama.cpp takes LongRoPE's long
    factors for a context past them (256 here), as transformers does for such prompts."""
    if family == "phi3":
        return [p for p in mixed_prompts() if len(p) > 32]
    return mixed_prompts()


def assert_greedy_close(ours: list[int], ref_ids: list[int], ref_logits) -> None:
    """Equal token for token, except that at the first difference ours may be the
    reference's runner-up within NEAR_TIE_NATS (llama.cpp keeps the KV cache in float16)."""
    assert len(ours) == len(ref_ids)
    for step, (a, b) in enumerate(zip(ours, ref_ids, strict=True)):
        if a != b:
            gap = (ref_logits[step][b] - ref_logits[step][a]).item()
            assert gap <= NEAR_TIE_NATS, (step, ours, ref_ids, gap)
            return


@pytest.mark.parametrize("family", FAMILIES)
async def test_gguf_greedy_matches_transformers(tmp_path_factory, family):
    directory = tmp_path_factory.mktemp("gguf-families")
    checkpoint = save_family(family, str(directory))
    path = write_gguf(checkpoint, str(directory / f"{family}.gguf"))
    refs = hf_greedy(checkpoint, prompts(family), MAX_NEW)
    engine = LocalEngine(EngineConfig(path, n_ctx=256, n_parallel=1, n_batch=64, n_threads=1))
    try:
        assert engine.model.architecture == ARCHITECTURE[family]
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        for i, (prompt, (ref_ids, ref_logits)) in enumerate(
            zip(prompts(family), refs, strict=True)
        ):
            ids, _, _ = await collect(engine, f"r{i}", prompt, params)
            assert_greedy_close(ids, ref_ids, ref_logits)
    finally:
        engine.shutdown()
