"""Ollama's native API (/api/*) on a real `kvgate serve` of fake models, the official
`ollama` client as the caller: chat and generate streamed and whole, embeddings, the
model listings, Ollama-shaped errors, one usage row a request, and a tenant's limits.

The fake backend's words mean nothing (it takes a mock_response only in OpenAI bodies),
so these check the replies' shape and counts, not their text.
"""

from __future__ import annotations

import httpx
import ollama
import pytest

from tests.conftest import start_gateway

CONFIG = """
[[backends]]
name = "chat"
type = "fake"
model = "fake-model"

[[backends]]
name = "embed"
type = "fake"
model = "fake-embed"
task = "embed"
"""
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gw = start_gateway(tmp_path_factory.mktemp("ollama"), config=CONFIG)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def key(gateway) -> str:
    return gateway.tenant_key("ollama-main")[1]


def client(gateway, key: str) -> ollama.Client:
    return ollama.Client(host=gateway.url, headers={"Authorization": f"Bearer {key}"})


def requests(gateway, key: str) -> int:
    """The tenant's usage rows so far, as its own key reads them."""
    r = httpx.get(gateway.url + "/admin/usage", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()["total"]["requests"]


def test_chat_whole_and_streamed(gateway, key):
    c = client(gateway, key)
    before = requests(gateway, key)
    whole = c.chat("fake-model:latest", HI, stream=False, options={"num_predict": 5})
    assert whole.done and whole.done_reason == "length"
    assert whole.message.role == "assistant" and len(whole.message.content.split()) == 5
    assert whole.eval_count == 5 and whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.eval_duration >= 0 and whole.load_duration == 0
    parts = list(c.chat("fake-model", HI, stream=True, options={"num_predict": 4, "seed": 3}))
    assert [p.done for p in parts] == [False] * 4 + [True]
    assert "".join(p.message.content for p in parts).split() and parts[-1].eval_count == 4
    assert requests(gateway, key) == before + 2


def test_chat_options_map_onto_sampling(gateway, key):
    c = client(gateway, key)
    opts = {"num_predict": 6, "seed": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20}
    a = c.chat("fake-model", HI, stream=False, options=opts | {"repeat_penalty": 1.1})
    b = c.chat("fake-model", HI, stream=False, options=opts | {"repeat_penalty": 1.1})
    assert a.message.content == b.message.content  # the seed is passed through
    stopped = c.chat(
        "fake-model", HI, stream=False, options=opts | {"stop": [a.message.content.split()[1]]}
    )
    assert stopped.done_reason == "stop" and stopped.eval_count < 6
    assert c.chat("fake-model", HI, stream=False, options={"num_ctx": 64, "num_predict": 1}).done


def test_chat_with_tools_format_and_think_is_served(gateway, key):
    c = client(gateway, key)
    tool = {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "the weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    history = [
        *HI,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "weather"},
    ]
    r = c.chat(
        "fake-model", history, tools=[tool], stream=False, think=False, options={"num_predict": 3}
    )
    assert r.done and r.eval_count == 3
    # format goes through the structured-output path, which the fake backend refuses
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fmt in ("json", schema):
        with pytest.raises(ollama.ResponseError) as e:
            c.chat("fake-model", HI, format=fmt, stream=False)
        assert e.value.status_code == 400 and "structured outputs" in e.value.error


def test_generate_templated_raw_and_load(gateway, key):
    c = client(gateway, key)
    r = c.generate(
        "fake-model", "Once upon", system="Be brief.", stream=False, options={"num_predict": 3}
    )
    assert r.done and r.eval_count == 3 and len(r.response.split()) == 3
    raw = list(
        c.generate("fake-model", "Once upon", raw=True, stream=True, options={"num_predict": 2})
    )
    assert raw[-1].done and raw[-1].done_reason == "length" and raw[-1].eval_count == 2
    assert "".join(p.response for p in raw).split()
    before = requests(gateway, key)
    load = c.generate("fake-model", "")
    assert load.done and load.done_reason == "load"
    loaded = c.chat("fake-model", [])
    assert loaded.done_reason == "load" and loaded.message.content == ""
    assert requests(gateway, key) == before  # nothing generated, nothing billed


def test_embed_and_the_older_embeddings(gateway, key):
    c = client(gateway, key)
    before = requests(gateway, key)
    r = c.embed("fake-embed", ["one", "two words"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 32 and r.prompt_eval_count == 3
    one = c.embeddings("fake-embed", "one")
    assert list(one.embedding) == list(r.embeddings[0])
    assert requests(gateway, key) == before + 2


def test_tags_ps_show_version(gateway, key):
    c = client(gateway, key)
    names = {m.model for m in c.list().models}
    assert names == {"fake-model:latest", "fake-embed:latest"}
    (m,) = [m for m in c.list().models if m.model == "fake-model:latest"]
    assert len(m.digest) == 64 and m.details.family == "fake" and m.modified_at is not None
    assert {m.model for m in c.ps().models} == names
    assert c.ps().models[0].expires_at.year > 2200
    shown = c.show("fake-model")
    assert shown.modelinfo["general.architecture"] == "fake"
    assert shown.modelinfo["fake.context_length"] > 0
    assert shown.capabilities == ["completion", "tools"]
    assert c.show("fake-embed:latest").capabilities == ["embedding"]
    assert httpx.get(gateway.url + "/api/version").json()["version"]


def test_errors_are_ollamas(gateway, key):
    c = client(gateway, key)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat("nope", HI)
    assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    with pytest.raises(ollama.ResponseError) as e:
        c.chat("fake-model", HI, options={"mirostat": 1})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.chat("fake-model", HI, options={"num_ctx": 10**7})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.generate("fake-model", "x", suffix="y")
    assert e.value.status_code == 400 and "suffix" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.embed("fake-model", "x")
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("fake-model")
    assert e.value.status_code == 501 and "copy" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:  # the models directory's: an admin's
        c.delete("fake-model")
    assert e.value.status_code == 403
    assert httpx.post(gateway.url + "/api/pull", json={"model": "x"}).status_code == 401
    bad = httpx.post(
        gateway.url + "/api/chat",
        json={"model": "fake-model", "messages": HI, "images": []},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert bad.status_code == 400 and "images" in bad.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        client(gateway, "sk-wrong").chat("fake-model", HI)
    assert e.value.status_code == 401 and set(httpx.get(gateway.url + "/api/tags").json()) == {
        "error"
    }


def test_a_body_sent_as_curls_form_data_is_read_as_json(gateway, key):
    """Ollama's documented `curl -d '{...}'`: a JSON body labelled form data."""
    body = (
        '{"model": "fake-model", "prompt": "Once", "stream": false, "options": {"num_predict": 2}}'
    )
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": "application/x-www-form-urlencoded",
    }
    r = httpx.post(gateway.url + "/api/generate", content=body, headers=headers)
    assert r.status_code == 200 and r.json()["eval_count"] == 2
    r = httpx.post(gateway.url + "/v1/completions", content=body, headers=headers)
    assert r.status_code == 415  # the OpenAI routes still take JSON alone


def test_another_tenants_limits(gateway, key):
    _, narrow = gateway.tenant_key("ollama-narrow", rpm=2, models=["fake-embed"])
    c = client(gateway, narrow)
    assert {m.model for m in c.list().models} == {"fake-embed:latest"}
    with pytest.raises(ollama.ResponseError) as e:
        c.chat("fake-model", HI)
    assert e.value.status_code == 403
    c.embed("fake-embed", "a")
    with pytest.raises(ollama.ResponseError) as e:
        c.embed("fake-embed", "b")
        c.embed("fake-embed", "c")
    assert e.value.status_code == 429
    assert (
        client(gateway, key).chat("fake-model", HI, stream=False, options={"num_predict": 1}).done
    )
