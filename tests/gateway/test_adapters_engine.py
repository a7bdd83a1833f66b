"""LoRA adapters end to end on a real engine: a tiny random Llama on the gpu engine (on the
CPU) with random PEFT adapters, through the `openai` client, in process and through a
`kvgate worker` process; and a random GGUF LoRA on the llama.cpp backend's default model. Registration is refused with the engine's reason for each kind of
bad adapter; an adapter changes the output; tenant B cannot see or use tenant A's adapter;
a prompt under an adapter shares no cached blocks with the base model, and the gateway's
block hashes for it are the engine's (the catalog matches them). On an engine started
without LoRA, either kind, the refusal says how to turn it on (the flag, the config key)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import openai
import pytest
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, LlamaConfig

from engine_api.records import AdapterRef
from gateway.backends import BackendSpec
from gateway.backends.default_model import DEFAULT_MODEL_ID
from gateway.routing.salts import tenant_cache_salt
from tests.backend_gpu.lora_adapters import save_random_adapter
from tests.backend_gpu.tiny_models import VOCAB, save_tiny_model
from tests.backend_local.lora_files import write_lora, write_peft_dir
from tests.gateway.test_worker import TOKEN, start_worker

pytestmark = pytest.mark.slow
PROMPT = "Paged attention keeps keys and values in blocks of sixteen tokens each. " * 3


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The tiny model, and adapters: two good ones, one of rank 16, one for a model of
    other shapes, one whose target module the engine does not know."""
    root = tmp_path_factory.mktemp("lora")
    model = save_tiny_model("llama", str(root))
    out = {"model": model}
    out["a"] = save_random_adapter(model, str(root / "a"), r=8, seed=1)
    out["b"] = save_random_adapter(model, str(root / "b"), r=4, targets=["q_proj", "v_proj"])
    out["rank16"] = save_random_adapter(model, str(root / "rank16"), r=16, seed=3)
    out["other"] = save_random_adapter(_wider_llama(str(root / "wide")), str(root / "other"), r=4)
    out["unknown"] = str(root / "unknown")
    shutil.copytree(out["b"], out["unknown"])
    config_file = os.path.join(out["unknown"], "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump(config | {"target_modules": ["q_proj", "router_proj"]}, f)
    return out


def _wider_llama(path: str) -> str:
    """A Llama of other widths: its adapters' shapes fit no tiny Llama."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def client(gw, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def complete(gw, key: str, model: str, prompt: str = PROMPT) -> tuple[str, int]:
    """Greedy text of `prompt` under `model`, and its cached prompt tokens."""
    answer = await client(gw, key).completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0
    )
    return answer.choices[0].text, answer.usage.prompt_tokens_details.cached_tokens


async def register(gw, name: str, path: str, tenant: str | None = None):
    body = {"name": name, "path": path, "base_model": "tiny", "tenant": tenant}
    return await gw.admin("POST", "/admin/adapters", body)


async def test_adapters_on_the_gpu_engine(make_gateway, files):
    options = {"seed": 1, "enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    gw = await make_gateway([BackendSpec("tiny", "gpu", files["model"], "tiny", options)])
    a, key_a = await gw.tenant("a")
    _, key_b = await gw.tenant("b")
    refused = {
        "ghost": ("/no/such/adapter", "no such directory"),
        "rank16": (files["rank16"], "above max_lora_rank 8"),
        "unknown": (files["unknown"], "router_proj"),
        "other": (files["other"], "do not fit the base model"),
        "tiny": (files["a"], "taken by a model"),
    }
    for name, (path, words) in refused.items():
        status, body = await register(gw, name, path)
        assert status == 400 and words in body["error"]["message"], (name, body)
    assert (await gw.admin("GET", "/admin/adapters"))[1]["data"] == []  # nothing half-stored
    assert (await register(gw, "a-lora", files["a"], tenant="a"))[0] == 201
    assert (await register(gw, "b-lora", files["b"]))[0] == 201
    assert (await register(gw, "b-lora", files["a"]))[0] == 400  # the name is taken

    base, base_cached = await complete(gw, key_a, "tiny")
    under_a, a_cached = await complete(gw, key_a, "a-lora")
    under_b, b_cached = await complete(gw, key_a, "b-lora")
    assert len({base, under_a, under_b}) == 3  # each adapter changes the greedy output
    assert (await complete(gw, key_a, "a-lora"))[0] == under_a
    # no cached block of the base model or another adapter serves an adapter: each first
    # call computed the whole prompt
    assert (base_cached, a_cached, b_cached) == (0, 0, 0)
    assert (await complete(gw, key_a, "a-lora"))[1] > 0  # its own blocks, the second time

    # the gateway hashes the adapter's prompt as the engine does: the catalog holds them
    tiny = gw.backend("tiny")
    tokens = await tiny.render("tiny", PROMPT)
    salt = tenant_cache_salt(gw.state.secret, a["id"])
    ref = AdapterRef("a-lora", files["a"])
    under = tiny.block_hashes(tokens, salt, 0, ref)
    assert under and set(under).isdisjoint(tiny.block_hashes(tokens, salt, 0))
    for _ in range(200):
        if gw.state.catalog.match("tiny", under) == len(under):
            break
        await asyncio.sleep(0.05)
    assert gw.state.catalog.match("tiny", under) == len(under)
    assert "a-lora" in tiny.stats().extra["adapters_loaded"]

    # tenant B: A's adapter does not exist; the public one does
    models_b = {m.id: m for m in (await client(gw, key_b).models.list()).data}
    assert "a-lora" not in models_b and models_b["b-lora"].parent == "tiny"
    with pytest.raises(openai.NotFoundError):
        await complete(gw, key_b, "a-lora")
    assert (await complete(gw, key_b, "b-lora"))[0] == under_b

    status, _ = await gw.admin("DELETE", "/admin/adapters/a-lora")
    assert status == 200
    await gw.state.adapters.stop()  # the unload, once nothing runs under it
    with pytest.raises(openai.NotFoundError):
        await complete(gw, key_a, "a-lora")
    assert "a-lora" not in tiny.stats().extra["adapters_loaded"]


async def test_adapters_through_a_worker(make_gateway, files, tmp_path):
    worker = start_worker(
        tmp_path,
        *("--backend", "gpu", "--model", files["model"], "--served-model-name", "tiny"),
        *("--enable-lora", "--max-lora-rank", "8", "--options", '{"seed": 1}'),
    )
    try:
        options = {"urls": [worker.url + "/v1"], "api_key": TOKEN}
        gw = await make_gateway([BackendSpec("up", "remote", "tiny", options=options)])
        (up,) = gw.state.backends
        while not up.stats().healthy:  # the health watch's first answer
            await asyncio.sleep(0.05)
        _, key = await gw.tenant("a")
        status, body = await register(gw, "big", files["rank16"])
        assert status == 400 and "above max_lora_rank 8" in body["error"]["message"]  # relayed
        assert (await register(gw, "a-lora", files["a"], tenant="a"))[0] == 201
        base, _ = await complete(gw, key, "tiny")
        under_a, _ = await complete(gw, key, "a-lora")
        assert under_a != base
        assert (await complete(gw, key, "a-lora"))[1] > 0  # its blocks, cached in the worker
        assert (await gw.admin("DELETE", "/admin/adapters/a-lora"))[0] == 200
        await gw.state.adapters.stop()  # the worker was told to drop it
        async with gw.http.get(worker.url + "/kvgate/v1/stats", headers=worker.headers) as r:
            assert "a-lora" not in (await r.json())["extra"]["adapters_loaded"]
    finally:
        worker.stop()


async def test_gguf_adapters_on_the_llama_cpp_backend(make_gateway, tmp_path):
    # one llama.cpp thread: two spin at its barriers beside the suite's other workers
    options = {"enable_lora": True, "n_ctx": 1024, "n_parallel": 2, "n_threads": 1}
    gw = await make_gateway([BackendSpec("local", "local", "", "", options)])
    lora = write_lora(tmp_path / "acme.gguf", gw.backend("local").engine.model, seed=3)
    _, key = await gw.tenant("a")
    status, body = await gw.admin(
        "POST",
        "/admin/adapters",
        {"name": "peft", "path": write_peft_dir(tmp_path / "peft"), "base_model": DEFAULT_MODEL_ID},
    )
    assert status == 400 and "convert_lora_to_gguf" in body["error"]["message"]
    body = {"name": "acme", "path": lora, "base_model": DEFAULT_MODEL_ID, "tenant": "a"}
    assert (await gw.admin("POST", "/admin/adapters", body))[0] == 201
    base, _ = await complete(gw, key, DEFAULT_MODEL_ID, "The capital of France is")
    under, _ = await complete(gw, key, "acme", "The capital of France is")
    assert under != base
    assert "acme" in gw.backend("local").stats().extra["adapters_loaded"]


async def test_an_engine_without_lora_says_how_to_turn_it_on(make_gateway, files):
    gw = await make_gateway(
        [
            BackendSpec("tiny", "gpu", files["model"], "tiny"),
            BackendSpec("local", "local", "", "", {"n_ctx": 256, "n_parallel": 1}),
        ]
    )
    for name, base in (("tiny", "tiny"), ("local", DEFAULT_MODEL_ID)):
        body = {"name": f"{name}-lora", "path": files["a"], "base_model": base}
        status, answer = await gw.admin("POST", "/admin/adapters", body)
        message = answer["error"]["message"]
        assert status == 400 and f"backend {name!r}" in message, answer
        assert "--enable-lora" in message and "enable_lora = true" in message, answer
