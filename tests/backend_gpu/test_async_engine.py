"""AsyncLLM: streaming from an asyncio loop, aborts, errors, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from backend_gpu import LLM, AsyncLLM, EngineDeadError, PromptTooLongError, SamplingParams
from tests.requests import req


@pytest.fixture
async def engine(tiny_model_dir):
    engine = AsyncLLM(tiny_model_dir("llama"), max_num_batched_tokens=32)
    yield engine
    await engine.shutdown()


async def collect(engine, prompt, params, request_id, **kwargs):
    return [out async for out in engine.generate(req(request_id, prompt, params, **kwargs))]


async def test_concurrent_streams_match_offline_greedy(engine, tiny_model_dir):
    prompts = [[5 + i] * (4 + 9 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    streams = await asyncio.gather(
        *(collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts))
    )
    offline = LLM(tiny_model_dir("llama")).generate(prompts, params)
    for stream, ref in zip(streams, offline, strict=True):
        assert [t for out in stream for t in out.new_token_ids] == ref.token_ids
        assert "".join(out.text_delta for out in stream) == ref.text
        assert stream[-1].finish_reason == "length"
        assert all(out.finish_reason is None for out in stream[:-1])
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


async def test_leaving_the_stream_early_aborts_and_frees_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stream = engine.generate(req("long", [5] * 30, params))
    async for out in stream:
        if len(out.token_ids) >= 3:
            break
    await stream.aclose()
    for _ in range(100):  # the abort is applied by the engine thread between steps
        stats = engine.stats()
        if stats.running == 0 and stats.num_free_blocks == stats.num_blocks:
            break
        await asyncio.sleep(0.02)
    assert stats.running == 0 and stats.num_free_blocks == stats.num_blocks


async def test_abort_ends_the_stream_and_unknown_abort_is_noop(engine):
    await engine.abort("never-seen")
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs = []
    async for out in engine.generate(req("victim", [6] * 10, params)):
        outs.append(out)
        if len(outs) == 2:
            await engine.abort("victim")
    assert outs[-1].finish_reason == "abort" and len(outs[-1].token_ids) < 200


async def test_bad_input_raises_before_streaming(engine):
    with pytest.raises(PromptTooLongError):
        await collect(engine, [5] * 1000, SamplingParams(), "x")
    with pytest.raises(ValueError, match="empty"):
        await collect(engine, [], SamplingParams(), "y")
    out = await collect(engine, [5, 6], SamplingParams(max_tokens=2), "x")  # id is free again
    assert len(out[-1].token_ids) == 2


async def test_cached_tokens_depend_on_the_salt(engine):
    prompt = list(range(10, 60))
    params = SamplingParams(temperature=0, max_tokens=2)
    first = await collect(engine, prompt, params, "a", cache_salt="tenant-1")
    again = await collect(engine, prompt, params, "b", cache_salt="tenant-1")
    other = await collect(engine, prompt, params, "c", cache_salt="tenant-2")
    assert first[-1].num_cached_tokens == 0
    assert again[-1].num_cached_tokens == 48
    assert other[-1].num_cached_tokens == 0


async def test_after_shutdown_requests_are_refused(tiny_model_dir):
    engine = AsyncLLM(tiny_model_dir("llama"))
    await engine.shutdown()
    with pytest.raises(EngineDeadError):
        await collect(engine, [5, 6], SamplingParams(), "z")
