"""LoRA adapters that break, on the real engines: PEFT adapters of a tiny random Llama on
the gpu engine (on the CPU), in process and through a `kvgate worker` process, and a
GGUF LoRA on the llama.cpp backend's default model, through the `openai` and
`anthropic` clients.

Registration refuses corrupt files with a 400 naming the file (random bytes, a file cut
short, a header, a header's string or a config past the size any real adapter has),
never a 500. Files that break after registration fail the request with a 500
`adapter_load_failed` naming the adapter, bill nothing and show the adapter `failed`
with the engine's reason in GET /admin/adapters; the engine serves on."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
from pathlib import Path

import anthropic
import openai
import pytest
from sqlalchemy import select

from gateway.backends import BackendSpec
from gateway.backends.default_model import DEFAULT_MODEL_ID
from gateway.db import UsageRecord
from tests.backend_gpu.lora_adapters import save_random_adapter
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.backend_local.lora_files import write_lora
from tests.gateway.test_worker import TOKEN, start_worker

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Paged attention keeps keys and values in blocks."}]
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    model = save_tiny_model("llama", str(root))
    return {"model": model, "good": save_random_adapter(model, str(root / "good"), r=4)}


def copy_of(good: str, where: Path) -> Path:
    shutil.copytree(good, where)
    return where


def cut(path: Path) -> None:
    """The file cut to half its size, as a copy that died half-way leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


async def register(gw, name: str, path: Path | str, base: str = "tiny") -> tuple[int, dict]:
    body = {"name": name, "path": str(path), "base_model": base}
    return await gw.admin("POST", "/admin/adapters", body)


async def usage_rows(gw) -> list[UsageRecord]:
    async with gw.state.db.session() as s:
        return list((await s.scalars(select(UsageRecord).order_by(UsageRecord.id))).all())


async def assert_load_fails(gw, key: str, name: str, reason: str, model: str = "tiny") -> None:
    """A request under `name` is a 500 adapter_load_failed naming it, in OpenAI's and
    Anthropic's shapes, with nothing billed; the registry shows why; the base serves."""
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        await client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4)
    assert e.value.code == "adapter_load_failed" and repr(name) in e.value.message
    messages = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.InternalServerError, match=f"{name!r} could not be loaded"):
        await messages.messages.create(model=name, max_tokens=4, messages=MESSAGES)
    failed = [r for r in await usage_rows(gw) if r.model == name]
    assert len(failed) == 2 and all(r.status == 500 for r in failed)
    assert all(r.prompt_tokens == r.completion_tokens == r.spend_nano_usd == 0 for r in failed)
    _, listed = await gw.admin("GET", "/admin/adapters")
    [adapter] = [a for a in listed["data"] if a["name"] == name]
    assert adapter["state"] == "failed" and reason in adapter["error"], adapter
    base = await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
    assert base.usage.completion_tokens == 4


async def test_corrupt_adapters_are_refused_naming_the_file(make_gateway, files, tmp_path):
    options = {"enable_lora": True, "max_lora_rank": 8}
    gw = await make_gateway([BackendSpec("tiny", "gpu", files["model"], "tiny", options)])
    noise = copy_of(files["good"], tmp_path / "noise")
    (noise / WEIGHTS).write_bytes(os.urandom(4096))
    short = copy_of(files["good"], tmp_path / "short")
    cut(short / WEIGHTS)
    header = copy_of(files["good"], tmp_path / "header")  # says its header is 1 TB long
    (header / WEIGHTS).write_bytes(struct.pack("<Q", 1 << 40) + b"{" * 1024)
    huge = copy_of(files["good"], tmp_path / "huge")  # valid JSON, 8 MB of it
    config = json.loads((huge / CONFIG).read_text())
    (huge / CONFIG).write_text(json.dumps(config | {"notes": "x" * (8 << 20)}))
    for name, file in [
        ("noise", WEIGHTS),
        ("short", WEIGHTS),
        ("header", WEIGHTS),
        ("huge", CONFIG),
    ]:
        status, body = await register(gw, name, tmp_path / name)
        assert status == 400, (name, body)
        assert file in body["error"]["message"], (name, body)
    assert (await gw.admin("GET", "/admin/adapters"))[1]["data"] == []
    assert (await register(gw, "good", files["good"]))[0] == 201


async def test_a_peft_adapter_broken_after_registration(make_gateway, files, tmp_path):
    options = {"enable_lora": True, "max_lora_rank": 8}
    gw = await make_gateway([BackendSpec("tiny", "gpu", files["model"], "tiny", options)])
    _, key = await gw.tenant()
    broken = copy_of(files["good"], tmp_path / "broken")
    assert (await register(gw, "broken", broken))[0] == 201
    kept = (broken / WEIGHTS).read_bytes()
    cut(broken / WEIGHTS)
    await assert_load_fails(gw, key, "broken", f"{WEIGHTS} is not readable")
    assert gw.backend("tiny").stats().healthy

    (broken / WEIGHTS).write_bytes(kept)  # mended: served, and ready again
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    answer = await client.chat.completions.create(model="broken", messages=MESSAGES, max_tokens=4)
    assert answer.usage.completion_tokens == 4
    _, listed = await gw.admin("GET", "/admin/adapters")
    assert listed["data"][0]["state"] == "ready"


async def test_a_peft_adapter_broken_after_registration_on_a_worker(
    make_gateway, files, tmp_path, caplog
):
    worker = start_worker(
        tmp_path,
        *("--backend", "gpu", "--model", files["model"], "--served-model-name", "tiny"),
        *("--enable-lora", "--max-lora-rank", "8"),
    )
    try:
        options = {"urls": [worker.url + "/v1"], "api_key": TOKEN}
        gw = await make_gateway([BackendSpec("up", "remote", "tiny", options=options)])
        (up,) = gw.state.backends
        while not up.stats().healthy:  # the health watch's first answer
            await asyncio.sleep(0.05)
        _, key = await gw.tenant()
        noise = copy_of(files["good"], tmp_path / "noise")
        (noise / WEIGHTS).write_bytes(os.urandom(4096))
        status, body = await register(gw, "noise", noise)
        assert status == 400 and WEIGHTS in body["error"]["message"], body  # relayed
        broken = copy_of(files["good"], tmp_path / "broken")
        assert (await register(gw, "broken", broken))[0] == 201
        (broken / WEIGHTS).unlink()
        caplog.clear()
        await assert_load_fails(gw, key, "broken", f"no {WEIGHTS}")  # the worker's reason
        assert up.stats().healthy
        said = [r.getMessage() for r in caplog.records if "HTTP 500" in r.getMessage()]
        failed = [
            r for r in caplog.records if "LoRA adapter broken failed to load" in r.getMessage()
        ]
        assert not said and len(failed) == 2  # a line a request, the registry's
    finally:
        worker.stop()


def bad_gguf_files(lora: Path) -> dict[str, Path]:
    """Beside `lora`: random bytes, its first 4 KB, and a header whose first key claims
    to be 1 TB long."""
    data = {"noise": os.urandom(4096), "short": lora.read_bytes()[:4096]}
    data["claims"] = b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 40) + b"x" * 64
    for name, content in data.items():
        (lora.parent / f"{name}.gguf").write_bytes(content)
    return {name: lora.parent / f"{name}.gguf" for name in data}


async def test_a_gguf_adapter_broken_after_registration(make_gateway, tmp_path):
    # one llama.cpp thread: two spin at its barriers beside the suite's other workers
    options = {"enable_lora": True, "n_ctx": 1024, "n_parallel": 2, "n_threads": 1}
    gw = await make_gateway([BackendSpec("local", "local", "", "", options)])
    _, key = await gw.tenant()
    lora = Path(write_lora(tmp_path / "acme.gguf", gw.backend("local").engine.model, seed=3))
    for name, path in bad_gguf_files(lora).items():
        status, body = await register(gw, name, path, DEFAULT_MODEL_ID)
        assert status == 400 and path.name in body["error"]["message"], (name, body)
    assert (await register(gw, "acme", lora, DEFAULT_MODEL_ID))[0] == 201
    await asyncio.to_thread(lora.unlink)
    await assert_load_fails(gw, key, "acme", "adapter file not found", DEFAULT_MODEL_ID)
    assert gw.backend("local").stats().healthy
