"""The OpenAI-shaped API over a real socket, on the fake backend."""

from __future__ import annotations

import asyncio
import json

from tests.conftest import ADMIN_KEY
from tests.gateway.conftest import fake_backends

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def _sse(resp) -> list:
    events = []
    async for line in resp.content:
        line = line.decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def _complete(gw, key: str, prompt, max_tokens: int, **fields):
    """POST /v1/completions for the fake model; `fields` add to the body after max_tokens."""
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": max_tokens, **fields}
    return await gw.post("/v1/completions", key, body)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_chat_completion_shape_and_usage(gw):
    _, key = await gw.tenant()
    r = await gw.chat(key, "one two three four", max_tokens=5)
    assert r.status == 200
    body = await r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["prompt_tokens"] > 4  # the rendered chat adds role words
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "image_tokens": 0}


async def test_content_parts_and_unsupported_parts(gw):
    _, key = await gw.tenant()
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    r = await gw.chat(key, parts, max_tokens=2)
    assert r.status == 200
    r = await gw.chat(key, [{"type": "image_url", "image_url": {"url": "x"}}], max_tokens=2)
    assert r.status == 400  # a model without vision (tests/gateway/test_images.py)
    assert "does not take images" in (await r.json())["error"]["message"]
    r = await gw.chat(key, [{"type": "input_audio", "input_audio": {}}], max_tokens=2)
    assert r.status == 400
    assert "'input_audio' are not supported" in (await r.json())["error"]["message"]


async def test_completions_prompt_forms_and_n(gw):
    _, key = await gw.tenant()
    r = await _complete(gw, key, "a b c", 3, n=2, seed=1, temperature=1.0)
    body = await r.json()
    assert r.status == 200, body
    assert body["object"] == "text_completion"
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    assert body["choices"][0]["text"] != body["choices"][1]["text"]  # seeds differ per choice
    assert body["usage"]["prompt_tokens"] == 3  # counted once for both choices
    assert body["usage"]["completion_tokens"] == 6
    r = await _complete(gw, key, [1001, 1002], 2)
    assert (await r.json())["usage"]["prompt_tokens"] == 2


async def test_seeded_sampling_is_reproducible(gw):
    _, key = await gw.tenant()
    texts = []
    for _ in range(2):
        r = await gw.chat(key, "repeat me", max_tokens=8, temperature=0.9, seed=42)
        texts.append((await r.json())["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]


async def test_stop_sequence_ends_generation(gw):
    _, key = await gw.tenant()
    r = await gw.chat(key, "x", max_tokens=40)
    full = (await r.json())["choices"][0]["message"]["content"]
    stop_word = full.split()[3]
    r = await gw.chat(key, "x", max_tokens=40, stop=[stop_word])
    body = await r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert stop_word not in body["choices"][0]["message"]["content"]
    assert full.startswith(body["choices"][0]["message"]["content"])


async def test_logprobs(gw):
    _, key = await gw.tenant()
    r = await gw.chat(key, "x", max_tokens=3, logprobs=True, top_logprobs=2)
    content = (await r.json())["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(len(item["top_logprobs"]) == 2 for item in content)
    r = await _complete(gw, key, "x", 3, logprobs=1)
    lp = (await r.json())["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and len(lp["text_offset"]) == 3


async def test_echo_repeats_each_prompt_before_its_completion(gw):
    """Completions' echo (no logprobs: the gateway's alone, so the fake serves it): each
    choice's text starts with its own prompt, whole or streamed as a first chunk; usage
    counts the prompt once, as without echo. With logprobs the engine must compute the
    prompt's: the fake has no model (its prompt ids are hashes of words) and that is a
    400."""
    _, key = await gw.tenant()
    prompts = ["first prompt here", "and a second one"]
    plain = await (await _complete(gw, key, prompts, 3, n=2, seed=5)).json()
    echoed = await (await _complete(gw, key, prompts, 3, n=2, seed=5, echo=True)).json()
    assert [c["text"] for c in echoed["choices"]] == [
        prompts[c["index"] // 2] + p["text"]
        for c, p in zip(echoed["choices"], plain["choices"], strict=True)
    ]
    assert echoed["usage"] == plain["usage"]
    r = await _complete(gw, key, prompts[0], 3, echo=True, stream=True)
    chunks = [e for e in await _sse(r) if e != "[DONE]"]
    assert chunks[0]["choices"][0]["text"] == prompts[0]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed.startswith(prompts[0]) and len(streamed) > len(prompts[0])
    r = await _complete(gw, key, prompts[0], 3, echo=True, logprobs=1)
    assert r.status == 400


async def test_streaming_with_usage(gw):
    _, key = await gw.tenant()
    with_usage = {"include_usage": True}
    r = await gw.chat(key, "stream this", max_tokens=6, stream=True, stream_options=with_usage)
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = await _sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"


async def test_streaming_without_usage_has_no_usage_chunk(gw):
    _, key = await gw.tenant()
    r = await _complete(gw, key, "x", 3, stream=True)
    events = await _sse(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])


async def test_client_disconnect_aborts_backend_request(make_gateway):
    gw = await make_gateway(fake_backends(tokens_per_second=50))
    _, key = await gw.tenant()
    r = await gw.chat(key, "long one", max_tokens=1000, stream=True)
    await r.content.readline()  # the stream has started
    r.close()  # hang up
    fake = gw.backend("fake")
    for _ in range(100):
        if fake.aborted:
            break
        await asyncio.sleep(0.05)
    assert len(fake.aborted) == 1
    assert fake.running == 0
    # the aborted request still has its usage row, with status 499
    for _ in range(100):
        status, usage = await gw.admin("GET", "/admin/usage")
        if usage["total"]["requests"] == 1:
            break
        await asyncio.sleep(0.05)
    assert usage["total"]["requests"] == 1
    assert 0 < usage["total"]["completion_tokens"] < 1000


async def test_models_lists_only_allowed(make_gateway):
    from gateway.backends import BackendSpec

    gw = await make_gateway(fake_backends() + [BackendSpec("other", "fake", "", "other-model")])
    _, key_all = await gw.tenant("all")
    _, key_one = await gw.tenant("one", models=["other-model"])
    async with gw.http.get(gw.url + "/v1/models", headers=_bearer(key_all)) as r:
        assert sorted(m["id"] for m in (await r.json())["data"]) == ["fake-model", "other-model"]
    async with gw.http.get(gw.url + "/v1/models", headers=_bearer(key_one)) as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["other-model"]


async def test_health_ready_metrics(gw):
    _, key = await gw.tenant("metered")
    await gw.chat(key, "count me", max_tokens=4)
    async with gw.http.get(gw.url + "/health") as r:
        assert r.status == 200
    async with gw.http.get(gw.url + "/ready") as r:
        assert r.status == 200 and (await r.json())["backends"] == {"fake": True}
    async with gw.http.get(gw.url + "/metrics") as r:  # it names tenants: not for anyone
        assert r.status == 401 and "metered" not in await r.text()
    async with gw.http.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 403 and "metered" not in await r.text()
    async with gw.http.get(gw.url + "/metrics", headers=ADMIN) as r:
        text = await r.text()
    assert 'kvgate:requests_total{model="fake-model",status="200",tenant="metered"} 1.0' in text
    assert 'kvgate:generation_tokens_total{model="fake-model",tenant="metered"} 4.0' in text
    assert "kvgate:time_to_first_token_seconds_bucket" in text
    assert 'kvgate:num_requests_running{backend="fake"} 0.0' in text


async def test_a_scraper_token_reads_metrics_and_nothing_else(make_gateway):
    token = "scrape-" + "s" * 32
    gw = await make_gateway(metrics_token=token)
    scraper = {"Authorization": f"Bearer {token}"}
    async with gw.http.get(gw.url + "/metrics", headers=scraper) as r:
        assert r.status == 200 and "kvgate:requests_total" in await r.text()
    async with gw.http.get(
        gw.url + "/metrics", headers={"Authorization": "Bearer " + "x" * 39}
    ) as r:
        assert r.status == 401
    async with gw.http.get(gw.url + "/admin/tenants", headers=scraper) as r:
        assert r.status == 401  # the token is not a key


async def test_metrics_open_when_configured(make_gateway):
    gw = await make_gateway(metrics_auth=False)
    async with gw.http.get(gw.url + "/metrics") as r:
        assert r.status == 200
