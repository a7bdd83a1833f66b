"""The gateway's `gpu` adapter over the engine, on a tiny model."""

from __future__ import annotations

import asyncio

import pytest

from gateway.backends import (
    BackendError,
    BackendSpec,
    BadRequestError,
    GenRequest,
    PromptTooLongError,
    SamplingParams,
    build_backend,
)


@pytest.fixture
async def backend(tiny_model_dir):
    spec = BackendSpec(
        name="gpu0",
        type="gpu",
        model=tiny_model_dir("llama"),
        options={"max_num_batched_tokens": 32, "seed": 1},
    )
    backend = build_backend(spec)
    await backend.start()
    yield backend
    await backend.stop(drain=False)


def request(request_id, prompt, salt=None, **sampling):
    sampling.setdefault("temperature", 0)
    return GenRequest(
        request_id=request_id,
        model="tiny-llama",
        prompt_token_ids=prompt,
        sampling=SamplingParams(**sampling),
        cache_salt=salt,
    )


async def test_model_card_and_render(backend):
    (card,) = backend.models()
    assert card.id == "tiny-llama" and card.context_length == 256
    ids = await backend.render("tiny-llama", [{"role": "user", "content": "The quick fox"}])
    text = backend.engine.tokenizer.decode(ids)
    assert text.startswith("<s><|start_header_id|>user") and text.count("<s>") == 1
    assert "The quick fox" in text and text.rstrip().endswith("assistant<|end_header_id|>")
    assert await backend.render("tiny-llama", [5, 6]) == [5, 6]
    with pytest.raises(BadRequestError):
        await backend.render("other-model", "hi")
    with pytest.raises(BadRequestError):
        await backend.render("tiny-llama", [])


async def test_generate_streams_chunks_with_usage(backend):
    chunks = [c async for c in backend.generate(request("r1", [5] * 20, max_tokens=6))]
    assert len(chunks) == 6 and all(len(c.token_ids) == 1 for c in chunks)
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == 20 and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    with_lp = [c async for c in backend.generate(request("r2", [5] * 20, max_tokens=2, logprobs=2))]
    assert with_lp[0].logprobs and len(with_lp[0].logprobs[0].top) == 2


async def test_closing_the_stream_aborts_and_frees_blocks(backend):
    stream = backend.generate(request("long", [6] * 40, max_tokens=200, ignore_eos=True))
    async for chunk in stream:
        assert chunk.finish_reason is None
        break
    await stream.aclose()
    for _ in range(100):
        stats = backend.stats()
        if stats.running == 0 and stats.extra["num_free_blocks"] == stats.extra["num_blocks"]:
            break
        await asyncio.sleep(0.02)
    assert stats.running == 0 and stats.extra["num_free_blocks"] == stats.extra["num_blocks"]


async def test_cached_tokens_only_with_the_same_salt(backend):
    prompt = list(range(10, 60))

    async def cached(request_id, salt):
        chunks = [
            c async for c in backend.generate(request(request_id, prompt, salt, max_tokens=2))
        ]
        return chunks[-1].usage.cached_tokens

    assert await cached("a", "tenant-1") == 0
    assert await cached("b", "tenant-1") == 48
    assert await cached("c", "tenant-2") == 0
    assert backend.stats().prefix_hits >= 48


async def test_errors_map_to_gateway_errors(backend):
    with pytest.raises(PromptTooLongError) as info:
        [c async for c in backend.generate(request("x", [5] * 300, max_tokens=5))]
    assert info.value.context_length == 256 and info.value.prompt_tokens == 300
    with pytest.raises(BadRequestError):
        [c async for c in backend.generate(request("y", [5, 6], max_tokens=0))]
    with pytest.raises(BadRequestError):
        [c async for c in backend.generate(request("z", []))]
    stats = backend.stats()
    assert stats.running == stats.waiting == 0


async def test_unknown_option_and_stopped_backend(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown options"):
        build_backend(BackendSpec(name="g", type="gpu", model="x", options={"bogus": 1}))
    backend = build_backend(BackendSpec(name="g", type="gpu", model=tiny_model_dir("llama")))
    with pytest.raises(BackendError):
        await backend.render("tiny-llama", "hi")
    assert backend.stats().healthy is False


async def test_tenant_and_weight_reach_the_engine_and_its_stats(backend):
    req = request("fair1", [5] * 20, max_tokens=4, ignore_eos=True)
    req.tenant_id, req.weight = "acme", 2.0
    chunks = [c async for c in backend.generate(req)]
    assert chunks[-1].usage.completion_tokens == 4
    for _ in range(100):  # the engine thread publishes its stats after the step
        share = backend.stats().extra["tenants"].get("acme")
        if share and share["running"] == 0:
            break
        await asyncio.sleep(0.02)
    # 20 prompt tokens and 4 output tokens, counted at half speed for weight 2
    assert share == {"weight": 2.0, "service": 24.0, "counter": 12.0, "waiting": 0, "running": 0}
    bad = request("fair2", [5, 6])
    bad.tenant_id, bad.weight = "acme", 0.0
    with pytest.raises(BadRequestError, match="weight"):
        [c async for c in backend.generate(bad)]
