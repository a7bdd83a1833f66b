"""Prompt logprobs (vLLM's `prompt_logprobs`) in the llama.cpp engine, with the real default
model (Gemma 3 270M Q4_K_M): each prompt token's logprob given the tokens before it, as the
engine itself reports a generated token's, with every prompt token computed again."""

import asyncio

import llama_cpp
import pytest

from backend_local import EngineConfig, LocalEngine, RequestOutput, SamplingParams
from backend_local import worker as worker_module
from backend_local.sampling import TokenLogprob
from backend_local.slots import Slot, place
from gateway.backends import BackendSpec, GenRequest, build_backend
from gateway.backends.default_model import DEFAULT_MODEL_ID
from tests.backend_local.helpers import NEAR_TIE_NATS, assert_same_up_to_near_tie, collect_logprobs
from tests.requests import req

pytestmark = pytest.mark.slow

N_BATCH = 24  # the test prompt spans several decode steps
# llama.cpp is not batch-invariant: the same row computed in another batch (another chunk
# split, beside other sequences) moves by up to about 0.2 nats on an AVX-512 build, and
# by 0.34 seen on an AVX2 one (tests/backend_local/helpers.py's near-tie bound)
DRIFT_NATS = NEAR_TIE_NATS
TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He wound "
    "the clockwork, polished the great lens, and lit the lamp that warned ships away from "
    "the rocks. In forty years he had never missed a single night, not even during the "
    "storm that took the roof off the boathouse."
)


@pytest.fixture(scope="module")
def engine(model_path):
    engine = LocalEngine(
        EngineConfig(model_path, n_ctx=2048, n_parallel=4, n_batch=N_BATCH, n_threads=1)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    prompt = engine.tokenize(TEXT)
    assert len(prompt) > 2 * N_BATCH + 2  # three chunks at least
    return prompt


def scoring(n: int, max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=n)


async def outputs(
    engine: LocalEngine, request_id: str, prompt: list[int], params: SamplingParams, salt: str
) -> list[RequestOutput]:
    return [out async for out in engine.generate(req(request_id, prompt, params, salt))]


async def prompt_logprobs(
    engine: LocalEngine, request_id: str, prompt: list[int], n: int, salt: str
) -> list[TokenLogprob | None]:
    """The prompt logprobs of one request, checked to come on its first output only."""
    first, *rest = await outputs(engine, request_id, prompt, scoring(n, 2), salt)
    assert all(out.prompt_logprobs is None for out in rest)
    lps = first.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    assert [lp.token_id for lp in lps[1:]] == prompt[1:]
    return lps


def assert_close(a: list[TokenLogprob | None], b: list[TokenLogprob | None], tol: float) -> None:
    """The same prompt logprobs within `tol` nats: the token's and its top list's values,
    the top ids in the same order except where two values are within `tol`."""
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x.token_id == y.token_id
        assert x.logprob == pytest.approx(y.logprob, abs=tol), (x, y)
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=tol), (x, y)
        for (t, v), (u, w) in zip(x.top, y.top, strict=True):
            assert t == u or abs(v - w) <= tol, (x, y)


class DecodeSpy:
    """Wraps llama_decode to record how many rows of logits each step asks for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        decode = llama_cpp.llama_decode

        def spy(ctx, batch):
            self.rows.append(sum(bool(batch.logits[i]) for i in range(batch.n_tokens)))
            return decode(ctx, batch)

        monkeypatch.setattr(worker_module.llama_cpp, "llama_decode", spy)


def test_placement_without_cache_reuse_takes_no_prefix_and_spares_cached_slots():
    cached, empty = Slot(0, cached=[1, 2, 3], salt="s"), Slot(1)
    assert place([cached, empty], [1, 2, 3, 4], "s").reuse == 3
    placement = place([cached, empty], [1, 2, 3, 4], "s", reuse_cache=False)
    assert (placement.slot, placement.source, placement.reuse) == (empty, None, 0)


async def test_prompt_logprobs_are_the_engines_logprobs_of_forcing_each_token(engine, prompt):
    """The prompt logprob of t[j+1] is the first output's logprob for the prompt t[..j]
    with t[j+1] forced by a logit bias (logprobs are the raw model's), at positions on both
    sides of the chunk boundaries; the top list is that row's, led by its argmax."""
    lps = await prompt_logprobs(engine, "scored", prompt, 3, "scored")
    for j in [0, 1, N_BATCH - 1, N_BATCH, N_BATCH + 1, 2 * N_BATCH, len(prompt) - 2]:
        target = prompt[j + 1]
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=3, logit_bias={target: 100})
        ids, (forced,), _ = await collect_logprobs(
            engine, f"forced-{j}", prompt[: j + 1], params, f"forced-{j}"
        )
        assert ids == [target]
        # the forced run's top list is its raw row's, led by the argmax
        assert_close([None, lps[j + 1]], [None, forced], DRIFT_NATS)


async def test_top_lists_have_n_entries_sorted_with_the_tokens_own_value(engine, prompt):
    lps = await prompt_logprobs(engine, "top-4", prompt, 4, "top-4")
    for lp in lps[1:]:
        values = [v for _, v in lp.top]
        assert len(lp.top) == 4 and len({t for t, _ in lp.top}) == 4
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert lp.logprob <= values[0]
        if lp.token_id in dict(lp.top):  # the same row: the same value
            assert dict(lp.top)[lp.token_id] == lp.logprob
    # n = 0: the tokens' own logprobs only, as computed with a top list
    bare = await prompt_logprobs(engine, "top-0", prompt, 0, "top-0")
    assert all(lp.top == [] for lp in bare[1:])
    assert [lp.logprob for lp in bare[1:]] == pytest.approx([lp.logprob for lp in lps[1:]])


async def test_a_repeated_request_computes_every_prompt_token_again(engine, prompt, monkeypatch):
    """No cached cell is reused for prompt logprobs, though the cells it computes serve
    the next request without them as usual."""
    spy = DecodeSpy(monkeypatch)
    queried = engine.stats().prefix_query_tokens
    first, *_ = await outputs(engine, "again-1", prompt, scoring(2), "again")
    spy.rows.clear()
    second, *_ = await outputs(engine, "again-2", prompt, scoring(2), "again")
    assert first.cached_tokens == second.cached_tokens == 0
    assert_close(first.prompt_logprobs, second.prompt_logprobs, 1e-4)
    # every prompt token had its logits, a chunk of n_batch at a time
    assert sum(spy.rows) == len(prompt) and max(spy.rows) == N_BATCH
    assert engine.stats().prefix_query_tokens == queried  # they looked nothing up
    plain, *_ = await outputs(engine, "again-plain", prompt, SamplingParams(max_tokens=1), "again")
    assert plain.cached_tokens == len(prompt) - 1 and plain.prompt_logprobs is None


async def test_logits_rows_per_step_are_capped(engine, prompt, monkeypatch):
    """A step computes at most PROMPT_LOGPROBS_ROWS rows; the chunks add up alike."""
    reference = await prompt_logprobs(engine, "uncapped", prompt, 2, "uncapped")
    monkeypatch.setattr(worker_module, "PROMPT_LOGPROBS_ROWS", 8)
    spy = DecodeSpy(monkeypatch)
    capped = await prompt_logprobs(engine, "capped", prompt, 2, "capped")
    assert max(spy.rows) == 8 and len(spy.rows) >= len(prompt) / 8
    assert_close(capped, reference, DRIFT_NATS)


async def test_a_plain_request_beside_one_with_prompt_logprobs_is_unaffected(engine, prompt):
    other = engine.tokenize("Three facts about the planet Mars:")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    solo_ids, solo_lps, _ = await collect_logprobs(engine, "plain-solo", other, params, "plain")
    solo = await prompt_logprobs(engine, "scored-solo", prompt, 2, "scored-solo")
    plain, scored = await asyncio.gather(
        outputs(engine, "plain-beside", other, params, "plain"),
        outputs(engine, "scored-beside", prompt, scoring(2, 4), "scored-beside"),
    )
    assert all(out.prompt_logprobs is None for out in plain)
    assert plain[-1].cached_tokens == len(other) - 1  # its cached prefix, as ever
    ids = [t for out in plain for t in out.token_ids]
    assert_same_up_to_near_tie(solo_ids, solo_lps, ids, [lp for o in plain for lp in o.logprobs])
    assert scored[-1].cached_tokens == 0
    assert_close(scored[0].prompt_logprobs, solo, DRIFT_NATS)


async def test_the_gateway_adapter_gives_them_token_strings_on_the_first_chunk(engine, prompt):
    reference = await prompt_logprobs(engine, "gw-reference", prompt, 2, "gw")
    options = {"n_ctx": 1024, "n_parallel": 2, "n_batch": N_BATCH, "n_threads": 1}
    backend = build_backend(BackendSpec(name="local", type="local", options=options))
    await backend.start()
    try:
        request = GenRequest("gw", DEFAULT_MODEL_ID, prompt, scoring(2, 3), "t", "s")
        first, *rest = [chunk async for chunk in backend.generate(request)]
    finally:
        await backend.stop()
    assert rest and all(chunk.prompt_logprobs is None for chunk in rest)
    text = engine.model.token_text
    lps = first.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for lp, ref in zip(lps[1:], reference[1:], strict=True):
        assert lp.token == text(ref.token_id)
        assert [t for t, _ in lp.top] == [text(t) for t, _ in ref.top]
        # another engine, the same chunks: the same computation
        assert lp.logprob == pytest.approx(ref.logprob, abs=1e-4)
