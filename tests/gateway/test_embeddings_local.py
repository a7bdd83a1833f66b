"""/v1/embeddings on a `type = "local"` entry with `options.task = "embed"`: llama.cpp
serving the default GGUF (Gemma 3 270M Q4_K_M) as an embedding model, mean-pooled, through
the gateway's HTTP API with the `openai` client. Its vectors are llama.cpp's own: equal to
llama-server's `--embedding --pooling mean` on the same file (where `make llama-server`
built it) and to llama-cpp-python's `Llama(embedding=True)`, to 1e-4 (cosine at least
0.9999), and its usage rows count the tokens llama-server counts.
"""

from __future__ import annotations

import httpx
import llama_cpp
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI
from sqlalchemy import select

from gateway.backends import BackendSpec
from gateway.backends.default_model import default_model_path
from gateway.db import UsageRecord
from tests.gateway.upstream_servers import llama_cpp_server, llama_server_binary

pytestmark = pytest.mark.slow

MODEL = "gemma-embed"
TEXTS = ["seven bright stars", "The capital of France is the city of light and bridges"]
CONTEXT = 64


def llama_server_answer(tmp_path) -> dict | None:
    """llama-server's /v1/embeddings answer for TEXTS, or None where it is not built."""
    binary = llama_server_binary()
    if binary is None:
        return None
    flags = ("--embedding", "--pooling", "mean")
    with llama_cpp_server(binary, tmp_path, MODEL, 512, *flags) as root:
        return httpx.post(root + "/v1/embeddings", json={"model": MODEL, "input": TEXTS}).json()


def llama_cpp_python_vectors() -> list[np.ndarray]:
    """llama-cpp-python's own mean-pooled vectors, normalized as llama-server's are (its
    create_embedding does not normalize), one text a call with flash attention, as
    llama-server decodes them on a CPU."""
    llama = llama_cpp.Llama(
        str(default_model_path()),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        flash_attn=True,
        verbose=False,
    )
    try:
        raw = [np.array(llama.create_embedding(t)["data"][0]["embedding"]) for t in TEXTS]
    finally:
        llama.close()
    return [v / np.linalg.norm(v) for v in raw]


def assert_close(got: list[list[float]], want: list) -> None:
    for g, w in zip(got, want, strict=True):
        g, w = np.array(g), np.array(w)
        assert np.abs(g - w).max() < 1e-4
        assert g @ w / (np.linalg.norm(g) * np.linalg.norm(w)) >= 0.9999


async def test_a_local_entry_embeds_the_default_gguf_as_llama_server_does(make_gateway, tmp_path):
    server = llama_server_answer(tmp_path)
    options = {"task": "embed", "pooling": "mean", "n_ctx": CONTEXT, "n_parallel": 1}
    specs = [
        BackendSpec("chat", "fake", "", "fake-model", {}),
        BackendSpec("embed", "local", "", MODEL, options | {"n_threads": 1}),
    ]
    gw = await make_gateway(specs)
    tenant, key = await gw.tenant(rpm=20)
    c = AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)

    models = {m.id: m for m in (await c.models.list()).data}
    assert (models[MODEL].task, models[MODEL].embedding_size) == ("embed", 640)
    assert models[MODEL].truncatable is False and models[MODEL].max_model_len == CONTEXT
    as_base64 = await c.embeddings.create(model=MODEL, input=TEXTS)  # the SDK's default
    as_floats = await c.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    vectors = [d.embedding for d in as_floats.data]
    assert_close([d.embedding for d in as_base64.data], vectors)
    assert_close(vectors, llama_cpp_python_vectors())
    tokens = as_floats.usage.prompt_tokens
    if server is not None:
        assert_close(vectors, [d["embedding"] for d in server["data"]])
        assert tokens == server["usage"]["prompt_tokens"]
    # one BOS each, as llama-server embeds them: "seven bright stars" is 3 tokens of text
    assert tokens == as_base64.usage.prompt_tokens and tokens > len(TEXTS) + 3

    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert f"`{MODEL}` is an embedding model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await c.embeddings.create(model=MODEL, input=["short", " ".join(["word"] * CONTEXT)])
    assert f"maximum context length is {CONTEXT} tokens. However, input 1" in e.value.message
    with pytest.raises(openai.BadRequestError):
        await c.embeddings.create(model=MODEL, input=[])
    with pytest.raises(openai.BadRequestError) as e:
        await c.embeddings.create(model=MODEL, input="x", dimensions=8)
    assert "does not support `dimensions`" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # past the vocabulary: the engine says so
        await c.embeddings.create(model=MODEL, input=[[2, 10**6]])
    assert "outside the vocabulary" in e.value.message
    again = await c.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert_close([again.data[0].embedding], vectors[1:])  # it serves on, the same vector

    async with gw.state.db.session() as s:
        rows = (await s.scalars(select(UsageRecord).order_by(UsageRecord.id))).all()
    assert all(r.model == MODEL and r.tenant_id == tenant["id"] for r in rows)
    second = again.usage.prompt_tokens
    assert [(r.status, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        (200, tokens, 0),
        (200, tokens, 0),
        (400, 0, 0),  # the engine refused it after admission: no tokens billed
        (200, second, 0),
    ]
