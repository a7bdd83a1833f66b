"""The engine with the real default model (Gemma 3 270M Q4_K_M), one instance per module."""

import asyncio

import pytest

from backend_local import (
    EngineConfig,
    LocalEngine,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
)
from backend_local.slots import common_prefix_len
from engine_api.errors import BadRequestError
from tests.backend_local.helpers import (
    NEAR_TIE_NATS,
    assert_same_up_to_near_tie,
    collect,
    collect_logprobs,
    wait_for,
)
from tests.requests import req

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The chemical formula of water is",
]


@pytest.fixture(scope="module")
def engine(model_path):
    engine = LocalEngine(
        EngineConfig(model_path, n_ctx=2048, n_parallel=4, n_batch=256, n_threads=1)
    )
    yield engine
    engine.shutdown()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


async def test_four_concurrent_greedy_requests_each_continue_their_own_prompt(engine, capsys):
    prompts = [engine.tokenize(p) for p in PROMPTS]
    params = greedy(16, logprobs=2)
    # Solo and batched runs use different salts, so the batch cannot reuse the solo cells.
    solo = [
        await collect_logprobs(engine, f"solo-{i}", p, params, "solo")
        for i, p in enumerate(prompts)
    ]
    batch = await asyncio.gather(
        *(collect_logprobs(engine, f"batch-{i}", p, params, "batch") for i, p in enumerate(prompts))
    )
    assert len({tuple(ids) for ids, _, _ in solo}) == 4  # four different continuations
    for (solo_ids, solo_lps, _), (ids, lps, last), prompt in zip(solo, batch, prompts, strict=True):
        assert_same_up_to_near_tie(solo_ids, solo_lps, ids, lps)
        assert last.prompt_tokens == len(prompt)
        assert last.completion_tokens == len(ids)
        # nothing from the solo cells; at most the prefix (the BOS) another batch prompt,
        # under the same salt, computed first
        shared = max(common_prefix_len(prompt, other) for other in prompts if other != prompt)
        assert last.cached_tokens <= shared < len(prompt)
    agree = sum(s[0] == b[0] for s, b in zip(solo, batch, strict=True))
    with capsys.disabled():
        print(f"\nfull agreement, 4 concurrent vs solo: {agree}/4")


async def test_prefix_is_reused_only_under_the_same_salt(engine):
    head = engine.tokenize(
        "A long shared system prompt about the history of the Roman empire. " * 3
    )
    first = head + engine.tokenize(" Question one:", add_special=False)
    second = head + engine.tokenize(" Question two:", add_special=False)
    before = engine.stats().prefix_reused_tokens
    _, _, out = await collect(engine, "salt-a1", first, greedy(4), "tenant-a")
    assert out.cached_tokens == 0
    ids_reused, _, out = await collect(engine, "salt-a2", second, greedy(8), "tenant-a")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert out.cached_tokens == shared
    ids_fresh, _, out = await collect(engine, "salt-b", second, greedy(8), "tenant-b")
    assert out.cached_tokens == 0
    # reused cells give the same continuation; only the first tokens must agree, as
    # llama.cpp is not batch-invariant (the exact logprobs are compared further down)
    assert ids_reused[:2] == ids_fresh[:2]
    assert engine.stats().prefix_reused_tokens - before == shared


async def test_aborted_stream_frees_its_sequence_for_a_waiting_request(engine):
    prompt = engine.tokenize("Count slowly: one, two, three,")
    params = greedy(400, ignore_eos=True)
    streams = [engine.generate(req(f"long-{i}", prompt, params)) for i in range(4)]
    for stream in streams:
        await anext(stream)  # all four sequences are busy
    waiting = asyncio.create_task(collect(engine, "waiter", prompt, greedy(3)))
    await wait_for(lambda: engine.stats().waiting == 1)
    assert engine.stats().free == 0
    await streams[0].aclose()  # a client disconnect
    _, _, out = await waiting  # the waiter got the freed sequence and finished
    assert out.finish_reason == "length" and out.completion_tokens == 3
    engine.abort("long-1")  # an abort by id ends the stream with finish_reason "abort"
    outputs = [out async for out in streams[1]]
    out = outputs[-1]
    assert out.finish_reason == "abort" and 0 < out.completion_tokens < 400
    for stream in streams[2:]:
        await stream.aclose()
    await wait_for(lambda: engine.stats().busy == 0)
    assert engine.stats().free == 4 and engine.stats().waiting == 0


async def test_stop_string_ends_generation_without_emitting_it(engine):
    prompt = engine.tokenize(PROMPTS[2])
    # Distinct salts: both runs compute the prompt from scratch, so they agree exactly.
    _, text, _ = await collect(engine, "nostop", prompt, greedy(24), "nostop")
    assert len(text) >= 12
    stop = text[8:12]
    ids, stopped_text, out = await collect(engine, "stop", prompt, greedy(24, stop=[stop]), "stop")
    assert out.finish_reason == "stop" and out.stop_sequence == stop
    assert stopped_text == text[: text.index(stop)]
    assert len(ids) < 24


async def test_bad_requests_are_refused_and_the_engine_keeps_serving(engine):
    prompt = engine.tokenize("Hello")
    with pytest.raises(PromptTooLongError, match="512"):
        await anext(engine.generate(req("big", [2] * 500, greedy(16))))
    with pytest.raises(ValueError, match="vocabulary"):
        await anext(engine.generate(req("bad-ids", [2, -1, 10**9], greedy(4))))
    with pytest.raises(ValueError, match="empty"):
        await anext(engine.generate(req("empty", [], greedy(4))))
    with pytest.raises(ValueError, match="temperature"):
        await anext(engine.generate(req("cold", prompt, SamplingParams(temperature=-1))))
    with pytest.raises(ValueError, match="logprobs"):
        await anext(engine.generate(req("many", prompt, greedy(4, logprobs=21))))
    ids, _, out = await collect(engine, "after", prompt, greedy(4))
    assert len(ids) == 4 and out.finish_reason == "length"
    assert engine.stats().busy == 0


async def test_seeded_sampling_repeats_and_logprobs_rank_the_greedy_token_first(engine):
    prompt = engine.tokenize("My favourite fruit is")
    sampled = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=12)
    runs = [await collect(engine, f"seed-{i}", prompt, sampled) for i in range(2)]
    assert runs[0][0] == runs[1][0]
    chunks = [out async for out in engine.generate(req("lp", prompt, greedy(5, logprobs=3)))]
    for out in chunks:
        (lp,) = out.logprobs
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


async def test_logit_bias_forces_a_token_through_the_argmax_and_the_sampler_chain(engine):
    prompt = engine.tokenize(PROMPTS[0])
    (banana,) = engine.tokenize(" banana", add_special=False)
    forced = {banana: 100}
    for i, params in enumerate(
        [
            greedy(5, logit_bias=forced),  # plain greedy: the row's argmax
            greedy(5, repetition_penalty=1.3, logit_bias=forced),  # a chain ending greedy
            SamplingParams(
                temperature=0.9, top_k=40, top_p=0.95, seed=5, max_tokens=5, logit_bias=forced
            ),
        ]
    ):
        ids, text, _ = await collect(engine, f"forced-{i}", prompt, params, f"forced-{i}")
        assert ids == [banana] * 5 and text == " banana" * 5, params
    # -100 on the model's choice: the runner-up comes instead, in either path
    _, lps, _ = await collect_logprobs(engine, "unbiased", prompt, greedy(1, logprobs=2), "u")
    (best, _), (runner_up, _) = lps[0].top
    assert best != banana  # and the bias did not outlive its requests
    for i, params in enumerate(
        [
            greedy(3, logit_bias={best: -100}),
            greedy(3, repetition_penalty=1.1, logit_bias={best: -100}),
        ]
    ):
        ids, _, _ = await collect(engine, f"banned-{i}", prompt, params, f"banned-{i}")
        assert ids[0] == runner_up and best not in ids


async def test_logit_bias_leaves_the_logprobs_the_models_own(engine):
    """A bias just big enough to make the runner-up win: the first token's logprobs are
    the unbiased run's, computed alike (fresh cells, a batch of one), to the last bit
    but for rounding."""
    prompt = engine.tokenize(PROMPTS[3])
    _, plain, _ = await collect_logprobs(engine, "lb-plain", prompt, greedy(1, logprobs=3), "p")
    (_, best_lp), (runner_up, runner_up_lp) = plain[0].top[:2]
    params = greedy(1, logprobs=3, logit_bias={runner_up: best_lp - runner_up_lp + 1})
    ids, biased, _ = await collect_logprobs(engine, "lb-biased", prompt, params, "b")
    assert ids == [runner_up] and biased[0].token_id == runner_up
    assert biased[0].logprob == pytest.approx(runner_up_lp, abs=1e-4)
    assert [t for t, _ in biased[0].top] == [t for t, _ in plain[0].top]
    assert [v for _, v in biased[0].top] == pytest.approx([v for _, v in plain[0].top], abs=1e-4)
    # and forced through the sampler chain (a seed) the logprobs are still the model's
    (banana,) = engine.tokenize(" banana", add_special=False)
    params = SamplingParams(
        temperature=0.7, seed=1, max_tokens=2, logprobs=1, logit_bias={banana: 100}
    )
    ids, lps, _ = await collect_logprobs(engine, "lb-chain", prompt, params, "c")
    assert ids == [banana] * 2
    assert all(lp.token_id == banana and lp.logprob < -1 for lp in lps)


async def test_logit_bias_past_the_vocabulary_is_refused(engine):
    prompt = engine.tokenize("Hello")
    n_vocab = engine.model.n_vocab
    engine.check_request(prompt, greedy(4, logit_bias={0: 1, n_vocab - 1: -1}))  # the edges
    bad = greedy(4, logit_bias={5: 1, n_vocab: 1})
    with pytest.raises(BadRequestError, match=rf"^logit_bias .*\[0, {n_vocab}\).*\[{n_vocab}\]"):
        engine.check_request(prompt, bad)
    with pytest.raises(BadRequestError, match="logit_bias"):
        await anext(engine.generate(req("oov-bias", prompt, bad)))
    with pytest.raises(BadRequestError, match="logit_bias"):  # validate(), before the vocabulary
        engine.check_request(prompt, greedy(4, logit_bias={5: 101}))
    assert engine.stats().busy == 0
    ids, _, _ = await collect(engine, "oov-after", prompt, greedy(2))
    assert len(ids) == 2


def assert_same_first_token(
    reused: RequestOutput, fresh: RequestOutput, tolerance: float = 1e-3
) -> None:
    """Reused (or copied) cells give the first token's logprobs of a fresh computation."""
    a, b = reused.logprobs[0], fresh.logprobs[0]
    assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert a.logprob == pytest.approx(b.logprob, abs=tolerance)


async def test_reused_prefix_gives_the_logprobs_of_a_fresh_computation(model_path):
    """The kept prefix sits in cells after the holes its new tokens fill: cells out of
    position order (llama.cpp's CPU flash attention got this wrong; the engine avoids it)."""
    engine = LocalEngine(EngineConfig(model_path, n_ctx=512, n_parallel=2, n_batch=64, n_threads=1))
    try:
        await collect(
            engine, "a", engine.tokenize("Hello there, how are you today, friend?"), greedy(4), "x"
        )
        await collect(engine, "b", engine.tokenize("The weather is"), greedy(4), "y")
        await collect(engine, "c", engine.tokenize("Hi"), greedy(1), "w")  # evicts slot a: holes
        prompt = engine.tokenize("My favourite fruit is")
        # "y" keeps its BOS cell, "fresh" computes every cell
        _, _, reused = await collect(engine, "y", prompt, greedy(1, logprobs=4), "y")
        _, _, fresh = await collect(engine, "fresh", prompt, greedy(1, logprobs=4), "fresh")
        assert reused.cached_tokens == 1 and fresh.cached_tokens == 0
        assert_same_first_token(reused, fresh)
    finally:
        engine.shutdown()


async def test_prefix_copied_from_another_stream_gives_the_logprobs_of_a_fresh_computation(
    model_path,
):
    """Each sequence has its own KV stream, so a published prefix reaches another sequence
    as a copy of the whole stream cut after the prefix: the source's own tokens beyond it
    (another tenant's) must be gone, not attended to."""
    config = EngineConfig(model_path, n_ctx=1536, n_parallel=3, n_batch=64, n_threads=1)
    engine = LocalEngine(config)
    try:
        head = engine.tokenize("Shared rules: be brief, be kind, cite sources. " * 4)
        prompt = head + engine.tokenize(" Which bread is best?", add_special=False)
        secret = engine.tokenize(" The vault code is 7391. Never reveal it.", add_special=False)
        await collect(engine, "a", head + secret, greedy(8), "tenant-a", len(head))
        params = greedy(1, logprobs=4)
        _, _, copied = await collect(engine, "b", prompt, params, "tenant-b", len(head))
        _, _, fresh = await collect(engine, "fresh", prompt, params, "fresh")
        assert copied.cached_tokens == len(head)  # copied from a's stream
        assert fresh.cached_tokens == 0
        # the copy's question is computed in other batch splits than the fresh prompt's:
        # without AVX-512, llama.cpp's CPU kernels move a logprob by ~0.1 nats with them
        # (NEAR_TIE_NATS); the secret attended to would change the ranking too
        assert_same_first_token(copied, fresh, NEAR_TIE_NATS)
    finally:
        engine.shutdown()


async def test_special_tokens_are_text_only_when_asked(engine):
    """vLLM's skip_special_tokens on llama.cpp: a turn marker forced by logit_bias is no
    text by default and its own text when kept (the output parsers' markers)."""
    (marker,) = engine.tokenize("<start_of_turn>", add_special=False)
    assert not engine.model.is_eog(marker)
    prompt = engine.tokenize("The capital of France is")
    forced = {"max_tokens": 2, "logit_bias": {marker: 100.0}}
    ids, skipped, _ = await collect(engine, "skip", prompt, greedy(**forced))
    kept_ids, kept, _ = await collect(
        engine, "keep", prompt, greedy(**forced, skip_special_tokens=False)
    )
    assert ids == kept_ids == [marker, marker]
    assert skipped == "" and kept == "<start_of_turn><start_of_turn>"
