"""/v1/embeddings through the gateway, the `openai` client as the caller: the answer's
shape as floats and as base64 (what the SDK asks for by default), quotas that count one
request and the input tokens (rpm exact under concurrency, daily tokens), usage rows with
the embedding model, its input price and no completion tokens, the failure paths that
settle what they took, and the 400s for what cannot be served: bad inputs, `dimensions`
on a model that cannot be cut, a chat model asked for vectors, an embedding model asked
for a completion.

These run on the fake backend's embedding model (deterministic vectors from the token
ids): they measure the gateway alone. The vectors themselves are the engine's, tested
against sentence-transformers in tests/gateway/test_embeddings_engine.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import time
from decimal import Decimal

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI
from sqlalchemy import select

from gateway.backends import BackendError, BackendSpec
from gateway.backends.remote_embed import parse_answer
from gateway.cli.chat import RemoteChat, Sampling
from gateway.db import Database, UsageRecord, migrate
from tests.conftest import ADMIN_KEY, PG_URL, away_from_minute_boundary

PRICES = {"embed-model": {"input": 2.5}}  # USD per million tokens
SIZE = 16


def backends(**embed_options) -> list[BackendSpec]:
    embed = {"task": "embed", "embedding_size": SIZE, "context_length": 64} | embed_options
    return [
        BackendSpec("chat", "fake", "", "fake-model", {}),
        BackendSpec("embed", "fake", "", "embed-model", embed),
        BackendSpec(
            "mrl", "fake", "", "mrl-model", {"task": "embed", "truncatable": True}
        ),  # Matryoshka-like: `dimensions` may cut its 32
    ]


@pytest.fixture
async def gw(make_gateway):
    return await make_gateway(backends(), prices=PRICES)


def client(gw, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def rows(gw) -> list[UsageRecord]:
    async with gw.state.db.session() as s:
        return list((await s.scalars(select(UsageRecord).order_by(UsageRecord.id))).all())


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def nanos(tokens: int, usd_per_million: float) -> int:
    usd = Decimal(str(usd_per_million)) * tokens / 10**6
    return int((usd * 10**9).to_integral_value("ROUND_CEILING"))


async def test_vectors_as_floats_and_base64_with_usage_rows_and_spend(gw):
    tenant, key = await gw.tenant()
    c = client(gw, key)
    as_floats = await c.embeddings.create(
        model="embed-model", input="the quick brown fox", encoding_format="float"
    )
    assert as_floats.object == "list" and as_floats.model == "embed-model"
    [one] = as_floats.data
    assert one.object == "embedding" and one.index == 0 and len(one.embedding) == SIZE
    assert abs(norm(one.embedding) - 1) < 1e-9
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == 4

    # the SDK asks for base64 by default and decodes it: float32 of the same vector
    texts = ["the quick brown fox", "jumps over", "the lazy dog today"]
    by_default = await c.embeddings.create(model="embed-model", input=texts)
    assert [d.index for d in by_default.data] == [0, 1, 2]
    assert by_default.usage.prompt_tokens == 4 + 2 + 4
    assert by_default.data[0].embedding == pytest.approx(one.embedding, abs=1e-6)
    assert by_default.data[1].embedding != by_default.data[0].embedding

    # the wire form itself: base64 of little-endian float32, as OpenAI sends it
    resp = await gw.post(
        "/v1/embeddings",
        key,
        {"model": "embed-model", "input": texts[1], "encoding_format": "base64"},
    )
    assert resp.status == 200, await resp.text()
    raw = base64.b64decode((await resp.json())["data"][0]["embedding"])
    assert list(struct.unpack(f"<{SIZE}f", raw)) == pytest.approx(
        by_default.data[1].embedding, abs=0
    )
    request_id = resp.headers["x-request-id"]
    assert request_id.startswith("embd-")

    # token ids, one input or several, as OpenAI takes them
    ids = await c.embeddings.create(model="embed-model", input=[1001, 1002, 1003], user="alice")
    many = await c.embeddings.create(model="embed-model", input=[[1001, 1002, 1003], [7, 8]])
    assert ids.usage.prompt_tokens == 3 and many.usage.prompt_tokens == 5
    assert many.data[0].embedding == ids.data[0].embedding

    recorded = await rows(gw)
    assert [r.prompt_tokens for r in recorded] == [4, 10, 2, 3, 5]
    assert recorded[2].request_id == request_id and recorded[3].user == "alice"
    for r in recorded:
        assert r.model == "embed-model" and r.tenant_id == tenant["id"]
        assert r.completion_tokens == 0 and r.status == 200 and r.counted_by == "engine"
        assert r.spend_nano_usd == nanos(r.prompt_tokens, 2.5)
    status, usage = await gw.admin("GET", f"/admin/usage?tenant_id={tenant['id']}")
    assert status == 200
    [day] = usage["data"]
    assert day["model"] == "embed-model" and day["prompt_tokens"] == 24
    assert day["spend"] == sum(r.spend_nano_usd for r in recorded) / 1e9


async def test_models_say_which_embed(gw):
    _, key = await gw.tenant()
    models = {m.id: m for m in (await client(gw, key).models.list()).data}
    assert models["fake-model"].task == "generate"
    assert not hasattr(models["fake-model"], "embedding_size")
    assert models["embed-model"].task == "embed"
    assert (models["embed-model"].embedding_size, models["embed-model"].truncatable) == (
        SIZE,
        False,
    )
    assert (models["mrl-model"].embedding_size, models["mrl-model"].truncatable) == (32, True)


async def test_dimensions_cut_a_truncatable_model_and_are_refused_elsewhere(gw):
    _, key = await gw.tenant()
    c = client(gw, key)
    whole = await c.embeddings.create(
        model="mrl-model", input="bright stars", encoding_format="float"
    )
    cut = await c.embeddings.create(
        model="mrl-model", input="bright stars", dimensions=8, encoding_format="float"
    )
    assert len(whole.data[0].embedding) == 32 and len(cut.data[0].embedding) == 8
    assert abs(norm(cut.data[0].embedding) - 1) < 1e-9  # normalized again after the cut
    first = whole.data[0].embedding[:8]
    assert cut.data[0].embedding == pytest.approx([x / norm(first) for x in first])
    for model, dims, says in (
        ("embed-model", 8, "does not support `dimensions`"),
        ("mrl-model", 33, "dimensions (33) is more than the 32"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await c.embeddings.create(model=model, input="x", dimensions=dims)
        assert says in e.value.message and e.value.body["param"] == "dimensions"
    assert len(await rows(gw)) == 2  # the refused ones left no row


async def test_each_model_is_asked_only_for_what_it_does(gw):
    _, key = await gw.tenant(rpm=2)
    c = client(gw, key)
    with pytest.raises(openai.BadRequestError) as e:
        await c.embeddings.create(model="fake-model", input="hello")
    assert "`fake-model` generates text" in e.value.message
    assert "Models that can: embed-model, mrl-model." in e.value.message
    assert e.value.code == "wrong_model_task"
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(
            model="embed-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert "`embed-model` is an embedding model (/v1/embeddings)" in e.value.message
    assert "Models that can: fake-model." in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await c.completions.create(model="mrl-model", prompt="hi", max_tokens=4)
    assert "`mrl-model` is an embedding model" in e.value.message
    # nothing was taken: both requests of the minute are still there
    await away_from_minute_boundary()
    await c.embeddings.create(model="embed-model", input="a")
    await c.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert [r.model for r in await rows(gw)] == ["embed-model", "fake-model"]


async def test_bad_inputs_are_400s_that_take_nothing(gw):
    tenant, key = await gw.tenant(rpm=1)
    body = {"model": "embed-model"}
    too_long = " ".join(["word"] * 65)  # the embed model's context is 64
    cases = [
        (body | {"input": ""}, "input must not be empty"),
        (body | {"input": []}, "input must not be empty"),
        (body | {"input": ["a", ""]}, "input must not be empty"),
        (body | {"input": [[1, 2], []]}, "input must not be empty"),
        (body | {"input": ["a"] * 2049}, "input holds 2049 items; at most 2048"),
        (body | {"input": [1.5]}, "input"),
        (body | {"input": "a", "encoding_format": "hex"}, "encoding_format"),
        (body | {"input": "a", "dimensions": 0}, "dimensions"),
        (body | {"input": "a", "extra": 1}, "'extra'"),
        (body | {"input": too_long}, "maximum context length is 64 tokens. However, input 0 is 65"),
        (body | {"input": ["ok", too_long]}, "input 1 is 65 tokens"),
        ({"model": "nope", "input": "a"}, "does not exist"),
    ]
    for sent, says in cases:
        resp = await gw.post("/v1/embeddings", key, sent)
        error = (await resp.json())["error"]
        assert resp.status == (404 if sent["model"] == "nope" else 400), (sent, error)
        assert says in error["message"], (sent, error)
    assert (await gw.post("/v1/embeddings", key, body | {"input": ["a"] * 2048})).status == 200
    assert len(await rows(gw)) == 1
    # one input of 3000 token ids is one input (the mrl model holds 4096)
    _, key = await gw.tenant("ids")
    long_ids = {"model": "mrl-model", "input": list(range(3000))}
    resp = await gw.post("/v1/embeddings", key, long_ids)
    assert resp.status == 200 and (await resp.json())["usage"]["prompt_tokens"] == 3000
    # no key, and an admin key, which has no tenant to bill
    assert (await gw.post("/v1/embeddings", None, body | {"input": "a"})).status == 401
    assert (await gw.post("/v1/embeddings", ADMIN_KEY, body | {"input": "a"})).status == 403


@pytest.fixture(params=["sqlite", "postgres"])
def store(request) -> dict:
    """SQLite (counters in memory) or PostgreSQL (counters in the database, each
    settlement committed with its usage row): the settings that pick it."""
    if request.param == "sqlite":
        return {}
    return {"database_url": PG_URL, "database_schema": request.getfixturevalue("pg_schema")}


async def on_store(make_gateway, store: dict, specs: list[BackendSpec] | None = None):
    if store and not store.get("migrated"):
        db = Database(store["database_url"], store["database_schema"])
        try:
            await migrate(db)  # as `kvgate serve` does at start
        finally:
            await db.close()
        store["migrated"] = True
    settings = {k: v for k, v in store.items() if k != "migrated"}
    return await make_gateway(specs or backends(), prices=PRICES, **settings)


async def test_rpm_is_exact_and_tokens_count_against_the_daily_budget(store, make_gateway):
    gw = await on_store(make_gateway, store)  # the schema outlives the gateway
    await away_from_minute_boundary()
    _, key = await gw.tenant("burst", rpm=5)
    c = client(gw, key)
    results = await asyncio.gather(
        *(c.embeddings.create(model="embed-model", input=["a b", "c"]) for _ in range(12)),
        return_exceptions=True,
    )
    ok = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(ok) == 5 and len(refused) == 7  # one request each, whatever its inputs
    assert "requests per minute (RPM): limit 5" in refused[0].message

    _, key = await gw.tenant("daily", daily_tokens=10)
    c = client(gw, key)
    for _ in range(2):
        await c.embeddings.create(model="embed-model", input="one two three four")
    with pytest.raises(openai.RateLimitError) as e:  # 8 used, 4 more is past 10
        await c.embeddings.create(model="embed-model", input="one two three four")
    assert "tokens per day: limit 10, used 8, requested 4 tokens" in e.value.message
    await c.embeddings.create(model="embed-model", input=["one", "two"])  # 10: fits
    with pytest.raises(openai.BadRequestError) as e:  # never admissible: a 400, not a 429
        await c.embeddings.create(model="embed-model", input=" ".join(["w"] * 11))
    assert e.value.code == "exceeds_tenant_limit" and "The input is 11 tokens" in e.value.message


async def test_a_failing_replica_hands_over_and_a_failed_request_settles(store, make_gateway):
    specs = backends()[:2]
    failing = BackendSpec("bad", "fake", "", "embed-model", specs[1].options | {"fail_rate": 1})
    gw = await on_store(make_gateway, store, [*specs, failing])
    _, key = await gw.tenant(max_concurrent=1)
    c = client(gw, key)
    for _ in range(4):  # whichever replica is picked first, every request is answered
        done = await c.embeddings.create(model="embed-model", input="seven bright stars")
        assert done.usage.prompt_tokens == 3

    gw = await on_store(make_gateway, store, [specs[0], failing])
    tenant, key = await gw.tenant("other", max_concurrent=1, rpm=2)
    c = client(gw, key)
    await away_from_minute_boundary()
    for _ in range(3):  # no replica left: a 503 that gives back the slot and the request
        with pytest.raises(openai.InternalServerError) as e:
            await c.embeddings.create(model="embed-model", input="seven bright stars")
        assert e.value.status_code == 503 and "failed the request" in e.value.message
    recorded = [r for r in await rows(gw) if r.tenant_id == tenant["id"]]
    assert [(r.status, r.prompt_tokens, r.spend_nano_usd) for r in recorded] == [(503, 0, 0)] * 3
    used = await gw.state.quota.used(tenant["id"], time.time())
    assert used["requests"] == 0 and used["concurrent"] == 0 and used["tokens"] == 0


def test_an_upstream_answer_is_checked_whole():
    """remote_embed's reading of a third-party answer: in index order, usage a claim;
    anything that does not fit the request is the upstream's failure, never passed on."""
    label = "remote backend 'up'"
    answer = {
        "data": [{"index": 1, "embedding": [0.5, 1]}, {"index": 0, "embedding": [1, 0]}],
        "usage": {"prompt_tokens": 7},
    }
    result = parse_answer(json.dumps(answer).encode(), 2, label)
    assert result.embeddings == [[1.0, 0.0], [0.5, 1.0]] and result.prompt_tokens == 7
    no_usage = parse_answer(json.dumps({"data": answer["data"]}).encode(), 2, label)
    assert no_usage.prompt_tokens == 0  # the gateway's own count then stands
    one, two = answer["data"]
    for raw, says in (
        (b"not json", "invalid JSON"),
        (json.dumps({"data": [one]}), "1 embeddings for 2 inputs"),
        (json.dumps({"data": [one, one]}), "wrong indices"),
        (json.dumps({"data": [one, two | {"index": 2}]}), "wrong indices"),
        (json.dumps({"data": [one, two | {"index": True}]}), "wrong indices"),
        (
            b'{"data": [{"index": 0, "embedding": [NaN, 1]}, ' + json.dumps(one).encode() + b"]}",
            "not a list of numbers",
        ),
        (json.dumps({"data": [one, two | {"embedding": "AAAA"}]}), "not a list of numbers"),
        (json.dumps({"data": [one, two | {"embedding": [1, 2, 3]}]}), "of different sizes"),
    ):
        with pytest.raises(BackendError) as e:
            parse_answer(raw if isinstance(raw, bytes) else raw.encode(), 2, label)
        assert str(e.value).startswith(label) and says in str(e.value), (raw, e.value)


async def test_an_embedding_model_takes_no_pin(gw):
    _, key = await gw.tenant()
    body = {"name": "house", "text": "You are helpful.", "model": "embed-model"}
    resp = await gw.post("/v1/prefixes", key, body)
    assert resp.status == 400
    assert "`embed-model` is an embedding model" in (await resp.json())["error"]["message"]
    assert await rows(gw) == []


async def test_the_fair_queue_holds_embeddings_to_max_in_flight(make_gateway):
    """A backend the gateway queues in front of (max_in_flight) gets one request at a
    time from one tenant; the others wait in line and are all answered."""
    gw = await make_gateway(backends(max_in_flight=1, ttft_ms=50), prices=PRICES)
    _, key = await gw.tenant()
    c = client(gw, key)
    fake, seen = gw.backend("embed"), []

    async def watch() -> None:
        while True:
            seen.append((fake.running, gw.state.queues["embed"].stats()))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        done = await asyncio.gather(
            *(c.embeddings.create(model="embed-model", input=f"word{i} more") for i in range(4))
        )
    finally:
        watcher.cancel()
    assert [d.usage.prompt_tokens for d in done] == [2] * 4
    assert max(running for running, _ in seen) == 1
    assert any(s and next(iter(s.values()))["waiting"] for _, s in seen)  # some waited
    [tenant] = gw.state.queues["embed"].stats().values()
    assert tenant["service"] == 8 and tenant["running"] == 0  # charged the input tokens


async def test_a_client_that_hangs_up_leaves_a_row_and_its_slot(make_gateway):
    gw = await make_gateway(backends(ttft_ms=2000), prices=PRICES)
    tenant, key = await gw.tenant(max_concurrent=1)
    body = {"model": "embed-model", "input": "seven bright stars"}
    with pytest.raises(TimeoutError):
        await gw.post("/v1/embeddings", key, body, timeout=aiohttp.ClientTimeout(total=0.3))
    for _ in range(100):  # the handler is cancelled when the connection closes
        if recorded := await rows(gw):
            break
        await asyncio.sleep(0.05)
    assert [(r.status, r.prompt_tokens, r.spend_nano_usd) for r in recorded] == [(499, 0, 0)]
    assert gw.backend("embed").running == 0  # the engine call was cancelled with it
    used = await gw.state.quota.used(tenant["id"], time.time())
    assert used["concurrent"] == 0 and used["tokens"] == 0


async def test_kvgate_chat_picks_a_model_that_chats(make_gateway):
    """`kvgate chat` without --model takes the first model that generates, not an
    embedding model listed before it."""
    gw = await make_gateway([*backends()[1:], backends()[0]], prices=PRICES)
    _, key = await gw.tenant()
    assert [m.id for m in (await client(gw, key).models.list()).data][0] == "embed-model"
    chat = RemoteChat(gw.url, key, None, Sampling(max_tokens=4, temperature=None))
    assert await asyncio.to_thread(chat.start) == f"fake-model at {gw.url}"


@pytest.fixture
async def third_party():
    """An OpenAI-compatible embeddings server on a real socket that tokenizes nothing for
    the gateway (no /tokenize): it answers one unit vector an input and the usage its
    `claim` says; `sent` keeps the bodies it was sent."""
    state: dict = {"claim": "words", "vectors": None, "sent": []}

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        state["sent"].append(body)
        texts = body["input"]
        vectors = state["vectors"] or [[1.0, 0.0]] * len(texts)
        answer: dict = {"data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]}
        claim = state["claim"]
        if claim is not None:
            words = sum(len(t.split()) for t in texts)
            answer["usage"] = {"prompt_tokens": words if claim == "words" else claim}
        return web.json_response(answer)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stub-embed", "max_model_len": 512}]})

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", lambda request: web.json_response({}))
    server = TestServer(app)
    await server.start_server()
    state["url"] = str(server.make_url("/v1"))
    yield state
    await server.close()


async def test_a_third_party_upstream_is_sent_text_and_its_usage_is_a_claim(
    make_gateway, third_party
):
    options = {"url": third_party["url"], "task": "embed", "health_interval_s": 0.2}
    gw = await make_gateway([BackendSpec("up", "remote", "stub-embed", "", options)])
    for _ in range(100):
        if gw.backend(next(b.name for b in gw.state.backends)).stats().healthy:
            break
        await asyncio.sleep(0.05)
    tenant, key = await gw.tenant()
    c = client(gw, key)
    texts = ["seven bright stars", "over the hills"]
    bound = sum(64 + len(t.encode()) for t in texts)  # no tokenizer: each input's text bound

    done = await c.embeddings.create(model="stub-embed", input=texts)
    assert third_party["sent"][-1] == {
        "model": "stub-embed",
        "encoding_format": "float",
        "input": texts,  # the client's texts, as the server takes them
    }
    assert done.usage.prompt_tokens == 6  # its count: within the bound, taken
    for claim in (10**9, None, 0):  # past the bound, none, less than one an input
        third_party["claim"] = claim
        done = await c.embeddings.create(model="stub-embed", input=texts)
        assert done.usage.prompt_tokens == bound  # the gateway's bound stands
    third_party["vectors"] = [[1.0, 0.0]]  # one vector for two inputs
    with pytest.raises(openai.InternalServerError) as e:
        await c.embeddings.create(model="stub-embed", input=texts)
    assert "1 embeddings for 2 inputs" in e.value.message
    assert "127.0.0.1" not in e.value.message  # the backend is named, not its address
    with pytest.raises(openai.BadRequestError) as e:  # ids mean nothing without its tokenizer
        await c.embeddings.create(model="stub-embed", input=[[1, 2, 3]])
    recorded = [(r.status, r.prompt_tokens, r.counted_by) for r in await rows(gw)]
    assert recorded == [
        (200, 6, "engine"),
        *[(200, bound, "gateway")] * 3,
        (503, 0, "engine"),
    ]
    used = await gw.state.quota.used(tenant["id"], time.time())
    assert used["concurrent"] == 0 and used["daily"] == 6 + 3 * bound
