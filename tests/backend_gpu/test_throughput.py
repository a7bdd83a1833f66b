"""Token rates of the gpu engine: fed once per step (engine_api.throughput, tested in
tests/engine_api), and reported by the gateway adapter without resetting them."""

from __future__ import annotations

import pytest

from backend_gpu import LLM, SamplingParams
from engine_api import throughput
from engine_api.throughput import RATE_WINDOW_S
from gateway.backends import BackendSpec, GenRequest, build_backend


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The time Throughput sees: set now[0] to move it."""
    now = [1000.0]
    monkeypatch.setattr(throughput, "monotonic", lambda: now[0])
    return now


def test_engine_counts_computed_prompt_and_generated_tokens_per_step(tiny_model_dir, clock):
    llm = LLM(tiny_model_dir("llama"), max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(range(10, 60))
    llm.generate(prompt, params)  # 50 prompt tokens, prefilled in two chunks
    assert llm.stats().prompt_tokens_per_s == 50 / RATE_WINDOW_S
    assert llm.stats().gen_tokens_per_s == 4 / RATE_WINDOW_S
    (out,) = llm.generate(prompt, params)  # 48 of them come from the prefix cache
    assert out.num_cached_tokens == 48
    stats = llm.stats()
    assert stats.prompt_tokens_per_s == (50 + 2) / RATE_WINDOW_S
    assert stats.gen_tokens_per_s == (4 + 4) / RATE_WINDOW_S
    clock[0] += RATE_WINDOW_S + 1
    stats = llm.stats()
    assert stats.prompt_tokens_per_s == stats.gen_tokens_per_s == 0.0
    assert stats.num_generated_tokens_total == 8


async def test_adapter_rates_survive_repeated_reads_and_decay_when_idle(tiny_model_dir, clock):
    backend = build_backend(BackendSpec("gpu0", "gpu", tiny_model_dir("llama"), "", {"seed": 1}))
    await backend.start()
    try:
        sampling = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        request = GenRequest("r1", "tiny-llama", list(range(10, 30)), sampling)
        chunks = [c async for c in backend.generate(request)]
        assert chunks[-1].usage.completion_tokens == 6
        first, second = backend.stats(), backend.stats()
        assert first.gen_tokens_per_s == 6 / RATE_WINDOW_S
        assert first.prompt_tokens_per_s == 20 / RATE_WINDOW_S
        # every caller (router, /metrics, dashboard) reads them: no read resets them
        assert (second.prompt_tokens_per_s, second.gen_tokens_per_s) == (
            first.prompt_tokens_per_s,
            first.gen_tokens_per_s,
        )
        # the idle engine takes no step, yet its rates fall once the window has passed
        clock[0] += RATE_WINDOW_S + 1
        idle = backend.stats()
        assert idle.prompt_tokens_per_s == idle.gen_tokens_per_s == 0.0
    finally:
        await backend.stop(drain=False)
