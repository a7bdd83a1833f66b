"""/tokenize and /detokenize on the gateway, in vLLM's shape: under a tenant's key and
its (and its key's) allowed models, OpenAI-shaped errors, never billed (their rpm is
test_counted_requests.py's); on the fake backend, a real tokenizer (the gpu engine's tiny
model), llama.cpp's default model and a remote `kvgate worker` (through its own /tokenize
and /detokenize). A chat's special tokens (its turn markers) come back as text, as vLLM's
do, unless skip_special_tokens; an upstream whose /detokenize cannot skip them says so."""

from __future__ import annotations

import asyncio

import pytest

from gateway.backends import BackendSpec
from gateway.backends.default_model import DEFAULT_MODEL_ID
from gateway.backends.fake import FakeBackend
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.gateway.test_remote import MODEL
from tests.gateway.test_remote_faults import FakeUpstream
from tests.gateway.test_worker import TOKEN, start_worker

PROMPT = "the gateway counts exactly what a completion gets"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


async def call(gw, key: str | None, path: str, body: dict) -> tuple[int, dict]:
    async with await gw.post(path, key, body) as r:
        return r.status, await r.json()


async def tokenize(gw, key: str, model: str, **body) -> tuple[int, dict]:
    return await call(gw, key, "/tokenize", {"model": model} | body)


async def detokenize(gw, key: str, model: str, tokens: list[int], **body) -> tuple[int, dict]:
    return await call(gw, key, "/detokenize", {"model": model, "tokens": tokens} | body)


async def test_tokenize_and_detokenize_on_the_fake_backend(gw):
    fake = FakeBackend(BackendSpec("fake", "fake", "", "fake-model"))
    tenant, key = await gw.tenant()
    status, body = await tokenize(gw, key, "fake-model", prompt=PROMPT)
    assert status == 200
    assert body == {
        "tokens": await fake.render("fake-model", PROMPT),
        "count": len(PROMPT.split()),
        "max_model_len": 4096,
    }
    status, body = await tokenize(gw, key, "fake-model", messages=MESSAGES)
    assert status == 200 and body["tokens"] == await fake.render("fake-model", MESSAGES)
    status, body = await detokenize(gw, key, "fake-model", [1, 2, 3])
    assert (status, body) == (200, {"prompt": "the quick brown"})

    # not billed: a completion's is the one usage row
    async with await gw.chat(key, max_tokens=2) as r:
        assert r.status == 200
    _, usage = await gw.admin("GET", f"/admin/usage?tenant_id={tenant['id']}")
    assert usage["total"]["requests"] == 1


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/tokenize", {"model": "fake-model"}, 400, "exactly one of prompt and messages"),
        ("/tokenize", {"model": "fake-model", "prompt": "x", "messages": MESSAGES}, 400, "one"),
        (
            "/tokenize",
            {"model": "fake-model", "prompt": "x", "add_special_tokens": False},
            400,
            "add_special_tokens",
        ),
        ("/tokenize", {"model": "fake-model", "prompt": "x", "truncate": 5}, 400, "'truncate'"),
        ("/tokenize", {"model": "fake-model", "prompt": 5}, 400, "prompt"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "nope"),
        ("/detokenize", {"model": "fake-model", "tokens": [10**6]}, 400, "vocabulary"),
        ("/detokenize", {"model": "fake-model", "tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "nope"),
    ],
)
async def test_bad_bodies_are_openai_errors(gw, path, body, status, says):
    _, key = await gw.tenant()
    got, error = await call(gw, key, path, body)
    assert got == status and says in error["error"]["message"], error


async def test_they_need_a_key_and_an_allowed_model(gw):
    text = {"model": "fake-model", "prompt": "x"}
    status, error = await call(gw, None, "/tokenize", text)
    assert status == 401 and error["error"]["code"] == "invalid_api_key"
    tenant, _ = await gw.tenant(models=["fake-model"])
    keys = f"/admin/tenants/{tenant['id']}/keys"
    status, key = await gw.admin("POST", keys, {"models": ["other-model"]})
    assert status == 201
    for path, body in (
        ("/tokenize", text),
        ("/detokenize", {"model": "fake-model", "tokens": [1]}),
    ):
        status, error = await call(gw, key["key"], path, body)
        assert status == 403 and error["error"]["code"] == "model_not_allowed", path


async def test_a_real_tokenizer_round_trips(make_gateway, tmp_path):
    spec = BackendSpec("gpu0", "gpu", save_tiny_model("llama", str(tmp_path)), "tiny-llama")
    spec.options = {"max_num_batched_tokens": 32}
    gw = await make_gateway([spec])
    _, key = await gw.tenant()
    text = "The quick brown fox jumps over the lazy dog."
    status, body = await tokenize(gw, key, "tiny-llama", prompt=text)
    assert status == 200 and body["count"] == len(body["tokens"]) > 1
    assert body["max_model_len"] == 256
    tokenizer = gw.backend("gpu0").engine.tokenizer
    assert body["tokens"] == tokenizer.encode(text)
    status, back = await detokenize(gw, key, "tiny-llama", body["tokens"])
    assert status == 200 and back["prompt"] == tokenizer.decode(body["tokens"])
    assert back["prompt"].endswith(text)
    status, chat = await tokenize(gw, key, "tiny-llama", messages=MESSAGES)
    rendered = await gw.backend("gpu0").render("tiny-llama", MESSAGES)
    assert status == 200 and chat["tokens"] == rendered
    # a chat's special tokens come back as text (vLLM's), unless asked to be skipped
    status, back = await detokenize(gw, key, "tiny-llama", rendered)
    assert status == 200 and back["prompt"] == tokenizer.decode(rendered)
    assert tokenizer.bos_token in back["prompt"]
    status, bare = await detokenize(gw, key, "tiny-llama", rendered, skip_special_tokens=True)
    assert status == 200 and bare["prompt"] == tokenizer.decode(rendered, skip_special_tokens=True)
    assert tokenizer.bos_token not in bare["prompt"]
    size = len(tokenizer)
    status, error = await detokenize(gw, key, "tiny-llama", [size])
    assert status == 400 and f"vocabulary (0..{size - 1})" in error["error"]["message"]


async def test_a_chat_prompt_keeps_its_turn_markers_on_llama_cpp(make_gateway):
    """The llama.cpp backend's default model (Gemma 3): /detokenize of a rendered chat
    gives the turn markers back as text, as the chat template wrote them; with
    skip_special_tokens only the words."""
    spec = BackendSpec("local", "local", "", "", {"n_ctx": 256, "n_parallel": 1})
    gw = await make_gateway([spec])
    _, key = await gw.tenant()
    status, chat = await tokenize(gw, key, DEFAULT_MODEL_ID, messages=MESSAGES)
    assert status == 200
    status, back = await detokenize(gw, key, DEFAULT_MODEL_ID, chat["tokens"])
    assert status == 200, back
    text = back["prompt"]
    assert text.startswith("<bos><start_of_turn>user\n") and "be brief" in text, text
    assert text.endswith("hi<end_of_turn>\n<start_of_turn>model\n"), text
    ask = {"skip_special_tokens": True}
    status, bare = await detokenize(gw, key, DEFAULT_MODEL_ID, chat["tokens"], **ask)
    assert status == 200 and "<" not in bare["prompt"] and "be brief" in bare["prompt"], bare


async def test_a_third_party_upstream_cannot_skip_special_tokens(make_gateway):
    """vLLM's /detokenize has no skip_special_tokens: asked of an upstream that would
    ignore it, the gateway says so instead of answering the markers."""
    with FakeUpstream("openai") as up:
        options = {"urls": [up.url], "context_length": 4096}
        gw = await make_gateway([BackendSpec("up", "remote", MODEL, options=options)])
        (remote,) = gw.state.backends
        while not remote.stats().healthy:  # the health watch's first answer
            await asyncio.sleep(0.05)
        _, key = await gw.tenant()
        status, error = await detokenize(gw, key, MODEL, [1, 2], skip_special_tokens=True)
        assert status == 400 and "cannot skip special tokens" in error["error"]["message"]
        assert "options.tokenizer" in error["error"]["message"]


async def test_through_a_remote_worker(make_gateway, tmp_path):
    worker = start_worker(tmp_path, "--backend", "fake")
    try:
        options = {"urls": [worker.url + "/v1"], "api_key": TOKEN, "context_length": 4096}
        gw = await make_gateway([BackendSpec("up", "remote", "fake-model", options=options)])
        (up,) = gw.state.backends
        while not up.stats().healthy:  # the health watch's first answer
            await asyncio.sleep(0.05)
        _, key = await gw.tenant()
        fake = FakeBackend(BackendSpec("fake", "fake", "", "fake-model"))
        status, body = await tokenize(gw, key, "fake-model", messages=MESSAGES)
        assert status == 200 and body["tokens"] == await fake.render("fake-model", MESSAGES)
        status, body = await detokenize(gw, key, "fake-model", [4, 5, 6])
        assert (status, body) == (200, {"prompt": "fox jumps over"})
        status, error = await detokenize(gw, key, "fake-model", [10**6])
        assert status == 400 and "vocabulary" in error["error"]["message"]  # the worker's word
    finally:
        worker.stop()
