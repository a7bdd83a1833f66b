"""Ollama's /api/chat on `kvgate serve` with the local backend (llama.cpp) and the
packaged SmolLM2 GGUF, the `ollama` client as the caller: a real reply streamed and
whole, `format` through the grammar engine, and what /api/show and /api/tags read off
the GGUF file."""

import json

import ollama
import pytest

from tests.conftest import start_gateway

pytestmark = pytest.mark.slow

CONFIG = """
[[backends]]
name = "local"
type = "local"
model = "smollm2-135m-instruct"
options = { n_ctx = 1024, n_parallel = 2, n_batch = 128, n_threads = 1 }
"""
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, model_path):
    gw = start_gateway(tmp_path_factory.mktemp("ollama-local"), config=CONFIG, timeout=120)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(gateway) -> ollama.Client:
    _, key = gateway.tenant_key("ollama-local")
    return ollama.Client(host=gateway.url, headers={"Authorization": f"Bearer {key}"})


def test_chat_streamed_and_whole_on_llama_cpp(client):
    (model,) = [m.model for m in client.list().models]
    opts = {"num_predict": 12, "temperature": 0, "seed": 1}
    whole = client.chat(model, ASK, stream=False, options=opts)
    assert whole.done and whole.message.content.strip() and whole.eval_count <= 12
    assert whole.prompt_eval_count > 5 and whole.done_reason in ("stop", "length")
    parts = list(client.chat(model, ASK, stream=True, options=opts))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    # greedy: the same words streamed as whole
    assert "".join(p.message.content for p in parts) == whole.message.content


def test_format_json_is_json(client):
    (model,) = [m.model for m in client.list().models]
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]}},
        "required": ["city"],
    }
    r = client.chat(model, ASK, format=schema, stream=False, options={"num_predict": 60})
    assert r.done_reason == "stop", r.message.content
    assert json.loads(r.message.content)["city"] in schema_cities(schema)


def test_show_and_tags_read_the_gguf(client):
    (listed,) = client.list().models
    assert listed.details.format == "gguf" and listed.size > 1_000_000
    shown = client.show(listed.model)
    arch = shown.modelinfo["general.architecture"]
    # a slot's context: n_ctx shared by n_parallel slots
    assert shown.modelinfo[f"{arch}.context_length"] == 512
    assert "completion" in shown.capabilities and shown.template


def schema_cities(schema: dict) -> list[str]:
    return schema["properties"]["city"]["enum"]
