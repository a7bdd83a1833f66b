"""Calibrated per-layer scales of the FP8 KV cache: set once at load from the built-in
text, and what they buy on keys and values outside E4M3's normal range."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_gpu import LLM, SamplingParams
from backend_gpu.quantization.kv_calibration import (
    K_HEADROOM,
    V_HEADROOM,
    calibration_token_ids,
)
from backend_gpu.scheduler import ScheduledBatch
from backend_gpu.sequence import Sequence
from tests.requests import req

# layer -> (factor on its keys, factor on its values): powers of two, so that the
# rescaled model below computes exactly what the original does
KV_FACTORS = {0: (2.0**10, 2.0**-10), 1: (2.0**-10, 2.0**10)}
PROMPT = [(7 * i + 5) % 380 + 4 for i in range(40)]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def rescaled_llama(tiny_llama, tmp_path_factory):
    """The tiny Llama with its keys and values pushed far outside E4M3's normal range
    (about 0.0156..448: below, mantissa bits are lost; above, values saturate) and its
    query and output projections rescaled to match: the same function."""
    path = tmp_path_factory.mktemp("rescaled") / "tiny-llama"
    shutil.copytree(tiny_llama, path)
    weights = load_file(path / "model.safetensors")
    for layer, (k_factor, v_factor) in KV_FACTORS.items():
        prefix = f"model.layers.{layer}.self_attn."
        weights[prefix + "k_proj.weight"] *= k_factor
        weights[prefix + "q_proj.weight"] /= k_factor
        weights[prefix + "v_proj.weight"] *= v_factor
        weights[prefix + "o_proj.weight"] /= v_factor
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def scales(llm: LLM) -> list[tuple[float, float]]:
    return [(attn.k_scale, attn.v_scale) for attn in llm.engine.runner.attention_layers]


def test_scales_are_per_layer_from_the_calibration_text_and_the_same_at_every_load(
    tiny_llama, rescaled_llama, caplog
):
    with caplog.at_level(logging.INFO, logger="backend_gpu.quantization.kv_calibration"):
        first, second = (LLM(tiny_llama, kv_cache_dtype="fp8") for _ in range(2))
    assert scales(first) == scales(second)
    assert len(scales(first)) == 2
    assert all(isinstance(s, float) and s > 0 for pair in scales(first) for s in pair)
    assert sum("FP8 KV cache scales" in r.getMessage() for r in caplog.records) == 2
    # the calibration leaves nothing behind: an empty cache, every block free
    for attn in first.engine.runner.attention_layers:
        assert not attn.k_cache.view(torch.uint8).any() and not attn.v_cache.view(torch.uint8).any()
    assert first.stats().num_free_blocks == first.stats().num_blocks
    # amax / headroom of K and V as the unquantized engine caches them for the same text
    ref = LLM(tiny_llama)
    assert scales(ref) == [(1.0, 1.0)] * 2
    text = calibration_token_ids(ref.engine.tokenizer, 256)
    run_chunks(ref, text, [(0, len(text))])
    for (k_scale, v_scale), attn in zip(
        scales(first), ref.engine.runner.attention_layers, strict=True
    ):
        assert k_scale == pytest.approx(attn.k_cache.abs().max().item() / K_HEADROOM, rel=1e-5)
        assert v_scale == pytest.approx(attn.v_cache.abs().max().item() / V_HEADROOM, rel=1e-5)
    # and they follow the layer's magnitudes
    rescaled = scales(LLM(rescaled_llama, kv_cache_dtype="fp8"))
    for layer, (k_factor, v_factor) in KV_FACTORS.items():
        assert rescaled[layer] == (
            scales(first)[layer][0] * k_factor,
            scales(first)[layer][1] * v_factor,
        )


@torch.inference_mode()
def run_chunks(llm: LLM, token_ids: list[int], steps: list[tuple[int, int]]) -> torch.Tensor:
    """Logits [T, V] of one sequence holding blocks 0, 1, ..., computed through the
    engine's runner in steps of (first position, tokens)."""
    runner = llm.engine.runner
    seq = Sequence(req("kv-scales", token_ids, SamplingParams(max_tokens=1)))
    seq.block_table = list(range(-(-len(token_ids) // runner.block_size)))
    logits = []
    for start, n in steps:
        seq.num_computed_tokens = start
        input_ids, positions, meta, _, _ = runner.prepare(ScheduledBatch([seq], [n]), None, [])
        logits.append(runner.model.compute_logits(runner.model(input_ids, positions, meta)))
    return torch.cat(logits).float()


def logits_read_through_the_cache(llm: LLM) -> torch.Tensor:
    """Logits at PROMPT's positions 12.., each computed from keys and values read back
    from the cache: a first chunk of 12 tokens (its own fresh keys), a second chunk that
    gathers the first's, then one decode step a token."""
    steps = [(0, 12), (12, 12)] + [(start, 1) for start in range(24, len(PROMPT))]
    return run_chunks(llm, PROMPT, steps)[12:]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("threads", [1, 2], ids=["one-by-one-decodes", "decode-groups"])
def test_calibrated_scales_keep_out_of_range_keys_and_values_close(
    tiny_llama, rescaled_llama, threads
):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)  # one thread: decodes one by one; more: padded groups
    try:
        want = logits_read_through_the_cache(LLM(rescaled_llama))
        original = logits_read_through_the_cache(LLM(tiny_llama, kv_cache_dtype="fp8"))
        llm = LLM(rescaled_llama, kv_cache_dtype="fp8")
        calibrated = logits_read_through_the_cache(llm)
        for attn in llm.engine.runner.attention_layers:
            attn.k_scale = attn.v_scale = 1.0
        unscaled = logits_read_through_the_cache(llm)
    finally:
        torch.set_num_threads(saved)
    # calibrated, the FP8 cache holds exactly what it holds for the original model
    torch.testing.assert_close(calibrated, original, rtol=1e-5, atol=1e-5)
    # FP8's own rounding (3 mantissa bits) moves this random model's logits by about 11%
    error = relative_error(calibrated, want)
    assert error < 0.2
    # scale 1.0: keys and values saturate or sink into subnormals (about 120%)
    assert relative_error(unscaled, want) > 5 * error
