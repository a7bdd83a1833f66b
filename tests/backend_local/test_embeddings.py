"""The llama.cpp engine as an embedding engine (task "embed") on the default GGUF (Gemma 3
270M Q4_K_M): its vectors equal llama-cpp-python's own `Llama(embedding=True)` on the same
file with the same pooling, one input at a time as llama-server decodes them; a vector
does not depend on what else was being embedded; what it cannot embed is refused before
any work and the engine serves on."""

import asyncio

import llama_cpp
import numpy as np
import pytest

from backend_local import EngineConfig, LocalEngine, PromptTooLongError
from backend_local.embed_worker import l2_normalized
from engine_api.errors import BadRequestError, EngineDeadError
from engine_api.records import EmbedRequest
from engine_api.sampling import SamplingParams
from tests.backend_local.helpers import wait_for
from tests.requests import req

pytestmark = pytest.mark.slow

TEXTS = ["seven bright stars", "The capital of France is the city of light and bridges"]
N_CTX = 64


def embed_engine(model_path: str, **options) -> LocalEngine:
    config = EngineConfig(
        model_path, n_ctx=N_CTX, n_parallel=1, n_threads=1, task="embed", **options
    )
    return LocalEngine(config)


@pytest.fixture(scope="module")
def engine(model_path):
    engine = embed_engine(model_path)
    yield engine
    engine.shutdown()


def reference(model_path: str, pooling: int, texts: list[str]) -> list[np.ndarray]:
    """llama-cpp-python's own embeddings (un-normalized), one text a call as llama-server
    decodes them, flash attention on as llama-server's default picks it on a CPU."""
    llama = llama_cpp.Llama(
        model_path, embedding=True, pooling_type=pooling, flash_attn=True, verbose=False
    )
    try:
        return [np.array(llama.create_embedding(t)["data"][0]["embedding"]) for t in texts]
    finally:
        llama.close()


def assert_close(got: list[list[float]], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want, strict=True):
        g = np.array(g)
        assert np.abs(g - w).max() < 1e-4
        assert g @ w / (np.linalg.norm(g) * np.linalg.norm(w)) >= 0.9999


def request(engine: LocalEngine, rid: str, texts: list[str], **kw) -> EmbedRequest:
    return EmbedRequest(rid, "m", [engine.tokenize(t) for t in texts], **kw)


async def test_mean_pooled_vectors_equal_llama_cpp_python_and_do_not_depend_on_the_batch(
    engine, model_path
):
    assert engine.pooling == "mean"  # Gemma's GGUF names no pooling of its own
    want = [l2_normalized(v) for v in reference(model_path, 1, TEXTS)]
    done = await engine.embed(request(engine, "a", TEXTS))
    assert_close(done.embeddings, want)
    assert [len(v) for v in done.embeddings] == [640, 640]
    assert np.linalg.norm(done.embeddings[0]) == pytest.approx(1.0, abs=1e-6)
    assert done.prompt_tokens == sum(len(engine.tokenize(t)) for t in TEXTS)
    assert engine.tokenize(TEXTS[0])[0] == engine.model.bos_id  # as llama-server embeds it

    # three requests at once, one of them cancelled: the others' vectors are as alone
    many = [asyncio.ensure_future(engine.embed(request(engine, f"b{i}", TEXTS))) for i in range(3)]
    await asyncio.sleep(0)
    many[1].cancel()
    for i in (0, 2):
        assert_close((await many[i]).embeddings, want)
    with pytest.raises(asyncio.CancelledError):
        await many[1]
    # the cancelled one's inputs are dropped: the worker goes idle
    await wait_for(lambda: engine.stats().busy == engine.stats().waiting == 0)
    assert engine.stats().prompt_tokens_total < 4 * done.prompt_tokens


async def test_what_it_cannot_embed_is_refused_and_it_serves_on(engine):
    with pytest.raises(PromptTooLongError) as e:
        await engine.embed(EmbedRequest("long", "m", [[2], [2] * (N_CTX + 1)]))
    assert e.value.context_length == N_CTX
    for inputs, says in [
        ([], "input is empty"),
        ([[2], []], "input 1 is empty"),
        ([[2, engine.model.n_vocab]], "outside the vocabulary"),
    ]:
        with pytest.raises(BadRequestError, match=says):
            await engine.embed(EmbedRequest("bad", "m", inputs))
    with pytest.raises(BadRequestError, match="dimensions"):
        await engine.embed(request(engine, "dims", ["x"], dimensions=8))
    with pytest.raises(BadRequestError, match="embedding model"):
        async for _ in engine.generate(req("gen", [2, 3], SamplingParams(max_tokens=2))):
            pass
    done = await engine.embed(request(engine, "after", TEXTS[:1]))
    assert len(done.embeddings) == 1 and engine.healthy


async def test_last_pooling_unnormalized_equals_llama_cpp_python_and_a_stop_ends_the_rest(
    model_path,
):
    engine = embed_engine(model_path, pooling="last", normalize=False)
    try:
        done = await engine.embed(request(engine, "last", TEXTS))
        assert_close(done.embeddings, reference(model_path, 3, TEXTS))
        assert np.linalg.norm(done.embeddings[0]) != pytest.approx(1.0, abs=1e-3)
        # stopped without draining: a request still waiting learns it, it does not hang
        waiting = asyncio.ensure_future(engine.embed(request(engine, "late", TEXTS * 20)))
        await asyncio.sleep(0)
        await engine.stop(drain=False)
        with pytest.raises(EngineDeadError):
            await waiting
    finally:
        engine.shutdown()
