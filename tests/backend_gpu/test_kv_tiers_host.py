"""The host tier under the KV cache (kv_offload_gb): prefixes that overflow a tiny
device pool go down to it and come back as cached tokens, with greedy output unchanged;
a block keeps its tenant's salt in the tier as on the device; the option is checked."""

from __future__ import annotations

import math
import random

import pytest

from backend_gpu import LLM, SamplingParams
from backend_gpu.config import EngineConfig
from tests.requests import req

BS = 8
# a block of the tiny llama: 2 layers x (K, V) x 8 rows x 2 heads x 16 dims x 4 bytes
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4
DEVICE_BLOCKS = 10  # two 40-token prompts at most; max_model_len 64 needs 8
HOST_GB = 64 * BLOCK_BYTES / (1 << 30)  # 64 blocks
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _llm(tiny_model_dir, **kwargs) -> LLM:
    return LLM(
        tiny_model_dir("llama"),
        block_size=BS,
        max_model_len=64,
        kv_cache_memory_bytes=DEVICE_BLOCKS * BLOCK_BYTES,
        **kwargs,
    )


def _prompts() -> list[list[int]]:
    rng = random.Random(33)
    return [[rng.randrange(4, 384) for _ in range(41)] for _ in range(4)]


def _serve_twice(llm: LLM) -> tuple[list[list[int]], int]:
    """Each prompt one after the other, twice round: its outputs and cached tokens."""
    outputs, cached = [], 0
    for prompt in _prompts() * 2:
        out = llm.generate([prompt], GREEDY)[0]
        outputs.append(out.token_ids)
        cached += out.num_cached_tokens
    return outputs, cached


def test_prefixes_overflowing_the_device_come_back_from_the_host_with_the_same_output(
    tiny_model_dir,
):
    plain = _llm(tiny_model_dir)
    tiered = _llm(tiny_model_dir, kv_offload_gb=HOST_GB)
    assert plain.stats().num_blocks == tiered.stats().num_blocks == DEVICE_BLOCKS
    plain_out, plain_cached = _serve_twice(plain)
    tiered_out, tiered_cached = _serve_twice(tiered)
    assert tiered_out == plain_out
    stats = tiered.stats()
    assert stats.kv_host_blocks_written > 0 and stats.kv_host_blocks_loaded > 0
    assert stats.kv_host_hits == stats.kv_host_blocks_loaded * BS
    # the second round finds every prompt's 5 full blocks (40 tokens) in some tier
    assert tiered_cached == 4 * 5 * BS > plain_cached
    assert stats.prefix_hits == tiered_cached
    assert stats.kv_host_bytes == stats.kv_host_blocks * BLOCK_BYTES > 0
    assert plain.stats().kv_host_blocks_written == 0


def test_a_host_tier_of_three_blocks_evicts_its_oldest_and_changes_no_output(tiny_model_dir):
    plain_out, _ = _serve_twice(_llm(tiny_model_dir))
    small = _llm(tiny_model_dir, kv_offload_gb=3 * BLOCK_BYTES / (1 << 30))
    small_out, _ = _serve_twice(small)
    assert small_out == plain_out
    stats = small.stats()
    assert stats.kv_host_blocks <= 3 < stats.kv_host_blocks_written


def test_a_block_written_down_under_one_salt_is_not_found_under_another(tiny_model_dir):
    llm = _llm(tiny_model_dir, kv_offload_gb=HOST_GB)
    engine = llm.engine
    prompt, *others = _prompts()

    def run(request_id: str, tokens: list[int], salt: str) -> int:
        engine.add_request(req(request_id, tokens, GREEDY, cache_salt=salt))
        cached = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                cached = out.num_cached_tokens
        return cached

    assert run("a", prompt, "tenant-a") == 0
    for i, other in enumerate(others):  # push A's blocks off the device
        run(f"filler-{i}", other, "tenant-a")
    assert llm.stats().kv_host_blocks_written >= 5
    assert run("b", prompt, "tenant-b") == 0
    assert llm.stats().kv_host_blocks_loaded == 0
    assert run("a-again", prompt, "tenant-a") == 5 * BS
    assert llm.stats().kv_host_blocks_loaded > 0


@pytest.mark.parametrize("gb", [-1, -0.5, math.nan, math.inf, "1", True])
def test_kv_offload_gb_must_be_a_finite_number_at_least_zero(gb):
    with pytest.raises(ValueError, match="kv_offload_gb"):
        EngineConfig(model="", kv_offload_gb=gb)


def test_zero_means_no_host_tier(tiny_model_dir):
    llm = _llm(tiny_model_dir, kv_offload_gb=0)
    assert llm.engine.kv_tiers is None and llm.engine.block_manager.lower_tier is None


def test_a_host_tier_smaller_than_a_block_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="less than one KV block"):
        _llm(tiny_model_dir, kv_offload_gb=BLOCK_BYTES / 2 / (1 << 30))
