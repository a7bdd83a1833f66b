"""Anthropic's Messages API through the gateway on the fake backend, the official
`anthropic` SDK as the caller: whole and streamed messages, stop sequences, tool turns,
count_tokens, errors in Anthropic's shape (typed by the SDK), exact rpm, usage rows and
spend, pings while a prefill takes long, and a client that hangs up billed for what it
read; every body and stream event as /openapi.json documents it. (The engines and
remote upstreams: test_messages_engines.py.)"""

from __future__ import annotations

import asyncio
import json

import anthropic
import jsonschema_rs
import pytest
from sqlalchemy import select

from gateway.backends import BackendSpec, GenChunk
from gateway.db import UsageRecord
from gateway.routes.openapi import build_document
from gateway.serving import messages_stream
from gateway.serving.messages_stream import MessageEvents, reply_content
from gateway.serving.parsed_output import ChoiceOutput, Whole
from gateway.serving.parser_choice import NONE as NO_PARSERS
from gateway.serving.tool_calls import ToolPlan
from tests.conftest import away_from_minute_boundary
from tests.gateway.test_spend import PRICES, expected_nanos

LONG_PROMPT = " ".join(f"w{i}" for i in range(40))  # two full 16-token blocks to cache
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}
HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3 C"},
            {"type": "text", "text": "Thanks; and tomorrow?"},
        ],
    },
]


def client(gw, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)


async def rows(gw) -> dict[str, UsageRecord]:
    """The usage rows by the id of the message they bill."""
    async with gw.state.db.session() as s:
        found = (await s.scalars(select(UsageRecord))).all()
    return {r.request_id: r for r in found}


def say(content: str | list) -> list[dict]:
    return [{"role": "user", "content": content}]


async def test_whole_and_streamed_messages_with_usage_rows_and_spend(make_gateway):
    gw = await make_gateway(prices={"fake-model": PRICES})
    _, key = await gw.tenant()
    c = client(gw, key)
    fields = dict(model="fake-model", max_tokens=6, system="Be brief.")
    first = await c.messages.create(messages=say(LONG_PROMPT), **fields)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.stop_reason == "max_tokens" and first.stop_sequence is None
    (block,) = first.content
    assert block.type == "text" and len(block.text.split()) == 6
    assert first.usage.output_tokens == 6 and first.usage.cache_read_input_tokens == 0
    counted = await c.messages.count_tokens(
        model="fake-model", system="Be brief.", messages=say(LONG_PROMPT)
    )
    assert counted.input_tokens == first.usage.input_tokens > 32

    # the same prompt again, streamed: its prefix blocks come from the cache
    async with c.messages.stream(messages=say(LONG_PROMPT), **fields) as stream:
        kinds = [event.type async for event in stream]
        again = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert again.content[0].text == block.text and again.stop_reason == "max_tokens"
    u = again.usage
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (32, 0)
    assert u.input_tokens + u.cache_read_input_tokens == first.usage.input_tokens
    assert u.output_tokens == 6

    # a stop sequence: the reply stops before it, and says which one matched
    sequence = " " + block.text.split()[3]
    stop = await c.messages.create(
        messages=say(LONG_PROMPT),
        stop_sequences=["never-said", sequence],
        metadata={"user_id": "user-7"},
        **fields,
    )
    assert stop.stop_reason == "stop_sequence" and stop.stop_sequence == sequence
    assert stop.content[0].text == block.text[: block.text.index(sequence)]

    recorded = await rows(gw)
    for done in (first, again, stop):
        row = recorded[done.id]
        cached = done.usage.cache_read_input_tokens
        prompt = done.usage.input_tokens + cached
        assert (row.prompt_tokens, row.cached_tokens, row.status) == (prompt, cached, 200)
        assert row.completion_tokens == done.usage.output_tokens
        assert row.spend_nano_usd == expected_nanos(
            PRICES, prompt, cached, done.usage.output_tokens
        )
    assert (recorded[stop.id].user, recorded[first.id].user) == ("user-7", None)
    assert recorded[stop.id].finish_reason == "stop"


async def test_tool_turns_and_tool_choice_on_a_backend_without_constraints(gw):
    _, key = await gw.tenant()
    c = client(gw, key)
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    reply = await c.messages.create(
        model="fake-model",
        max_tokens=4,
        messages=HISTORY,
        system=system,
        tools=[TOOL],
        tool_choice={"type": "auto"},
        cache_control={"type": "ephemeral"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},  # not in the SDK's 2.x
    )
    # the fake model writes words, never a call: a reply in text, as auto allows
    assert [b.type for b in reply.content] == ["text"] and reply.stop_reason == "max_tokens"
    counted = await c.messages.count_tokens(
        model="fake-model", messages=HISTORY, system=system, tools=[TOOL]
    )
    # the same rendering as the reply's prompt
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    # a forced call needs a constrained engine, which the fake is not: its 400, by name
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        with pytest.raises(anthropic.BadRequestError, match="cannot constrain"):
            await c.messages.create(
                model="fake-model",
                max_tokens=4,
                messages=say("hi"),
                tools=[TOOL],
                tool_choice=choice,
            )


async def test_errors_are_anthropic_shaped_and_typed(make_gateway):
    gw = await make_gateway(max_body_bytes=4096)
    _, key = await gw.tenant()
    c = client(gw, key)
    ok = dict(model="fake-model", max_tokens=4, messages=say("hi"))
    bad_key = anthropic.AsyncAnthropic(base_url=gw.url, api_key="kvg-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        await bad_key.messages.create(**ok)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError, match="Available: fake-model"):
        await c.messages.create(**ok | {"model": "nope"})
    cases = [
        ({"thinking": {"type": "enabled"}}, "needs budget_tokens"),
        ({"messages": say([{"type": "document", "source": {}}])}, "'document' are not supported"),
        ({"messages": say([{"type": "image", "source": {}}])}, "source"),
        ({"messages": say("hi") + [{"role": "assistant", "content": "Sure"}]}, "prefilled"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "x"}}, "not in tools"),
        ({"extra_body": {"temperature": 1.5}}, "temperature"),
        ({"tools": [TOOL | {"type": "web_search_20250305"}]}, "type"),
    ]
    for fields, message in cases:
        with pytest.raises(anthropic.BadRequestError, match=message) as e:
            await c.messages.create(**ok | fields)
        assert e.value.body["error"]["type"] == "invalid_request_error"

    # the SDK asks for max_tokens itself; aiohttp's own errors (404, 405, 413) on these
    # routes come in the same shape
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    cases = [
        (
            "POST",
            "/v1/messages",
            {"model": "fake-model", "messages": say("hi")},
            400,
            "invalid_request_error",
        ),
        ("GET", "/v1/messages", None, 405, "invalid_request_error"),
        ("POST", "/v1/messages/nope", {}, 404, "not_found_error"),
        ("POST", "/v1/messages", ok | {"system": "x" * 5000}, 413, "request_too_large"),
    ]
    for method, path, body, status, kind in cases:
        async with gw.http.request(method, gw.url + path, json=body, headers=headers) as r:
            assert r.status == status
            assert (await r.json())["error"]["type"] == kind
    async with gw.http.post(gw.url + "/v1/chat/completions", json={}) as r:
        assert r.status == 401 and "type" not in await r.json()  # OpenAI's shape stays


async def test_a_failing_backend_is_overloaded_whole_and_an_error_event_streamed(make_gateway):
    gw = await make_gateway([BackendSpec("fake", "fake", "", "fake-model", {"fail_rate": 1.0})])
    tenant, key = await gw.tenant()
    c = client(gw, key)
    with pytest.raises(anthropic.OverloadedError) as e:
        await c.messages.create(model="fake-model", max_tokens=4, messages=say("hi"))
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
    with pytest.raises(anthropic.APIStatusError, match="failed the request"):
        async with c.messages.stream(model="fake-model", max_tokens=4, messages=say("hi")) as s:
            async for _ in s:
                pass
    statuses = sorted(r.status for r in (await rows(gw)).values())
    assert statuses == [503, 503]  # each recorded, none billed
    assert all(r.completion_tokens == 0 for r in (await rows(gw)).values())


async def test_rpm_is_exact_and_a_refusal_says_when_to_retry(gw):
    tenant, key = await gw.tenant(rpm=3)
    c = client(gw, key)
    await away_from_minute_boundary()
    results = await asyncio.gather(
        *(
            c.messages.create(model="fake-model", max_tokens=2, messages=say(f"hi {i}"))
            for i in range(6)
        ),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(refused) == 3 and all(isinstance(r, anthropic.RateLimitError) for r in refused)
    for r in refused:
        assert int(r.response.headers["retry-after"]) >= 1
        assert r.response.headers["x-ratelimit-limit-requests"] == "3"
        assert r.body["error"]["type"] == "rate_limit_error"
    # count_tokens is not billed, but it is a request of the minute: refused as the rest
    with pytest.raises(anthropic.RateLimitError):
        await c.messages.count_tokens(model="fake-model", messages=say("hi"))
    assert len(await rows(gw)) == 3


async def test_pings_while_waiting_and_a_hang_up_billed_for_what_was_read(
    make_gateway, monkeypatch
):
    monkeypatch.setattr(messages_stream, "PING_EVERY_S", 0.05)
    options = {"ttft_ms": 400, "tokens_per_second": 20}
    gw = await make_gateway([BackendSpec("fake", "fake", "", "fake-model", options)])
    _, key = await gw.tenant()
    body = {"model": "fake-model", "max_tokens": 200, "messages": say("hi"), "stream": True}
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    names: list[str] = []
    # the SDK hides pings: read the wire
    async with gw.http.post(gw.url + "/v1/messages", json=body, headers=headers) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        async for line in r.content:
            if line.startswith(b"event: "):
                names.append(line[7:].strip().decode())
            elif line.startswith(b"data: ") and names[-1] == "content_block_delta":
                assert json.loads(line[6:])["delta"]["type"] == "text_delta"
            if names.count("content_block_delta") == 3:
                r.close()  # hang up
                break
    assert names[:2] == ["message_start", "ping"]
    # pings while the prefill took its 400 ms, then the text block
    first_block = names.index("content_block_start")
    assert first_block > 2 and set(names[1:first_block]) == {"ping"}

    async def row() -> UsageRecord | None:
        return next(iter((await rows(gw)).values()), None)

    for _ in range(100):
        if (found := await row()) is not None:
            break
        await asyncio.sleep(0.05)
    assert found is not None and found.status == 499
    assert 3 <= found.completion_tokens < 200


async def test_bodies_and_events_are_as_documented(gw):
    """A whole reply, each event of a stream, a count and an error, each valid for the
    schema /openapi.json gives its route and status (the fuzzer checks many more)."""
    _, key = await gw.tenant()
    doc = build_document("fake-model")

    def validate(path: str, status: int, media: str, data: object) -> None:
        response = doc["paths"][path]["post"]["responses"][str(status)]
        if "$ref" in response:
            response = doc["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
        schema = response["content"][media]["schema"]
        if media == "text/event-stream":
            schema = schema["properties"]["data"]["else"]["contentSchema"]
        jsonschema_rs.Draft202012Validator(schema | {"components": doc["components"]}).validate(
            data
        )

    headers = {"x-api-key": key}
    body = {"model": "fake-model", "max_tokens": 4, "messages": say("hi")}
    calls = [
        ("/v1/messages", body, 200),
        ("/v1/messages", body | {"stream": True}, 200),
        ("/v1/messages/count_tokens", {"model": "fake-model", "messages": say("hi")}, 200),
        ("/v1/messages", body | {"top_k": 0}, 400),
    ]
    for path, sent, status in calls:
        async with gw.http.post(gw.url + path, json=sent, headers=headers) as r:
            assert r.status == status
            media, raw = r.content_type, await r.text()
        if media == "application/json":
            validate(path, status, media, json.loads(raw))
            continue
        events = [e.split("\n") for e in raw.split("\n\n") if e]
        for name, data in events:
            event = json.loads(data.removeprefix("data: "))
            assert name == "event: " + event["type"]
            validate(path, status, media, event)
        assert [e[0] for e in events[-2:]] == ["event: message_delta", "event: message_stop"]


async def test_a_reply_whose_usage_row_is_not_committed_does_not_complete(gw, monkeypatch):
    _, key = await gw.tenant()
    c = client(gw, key)

    def lost(row) -> asyncio.Future[None]:
        failed = asyncio.get_running_loop().create_future()
        failed.set_exception(RuntimeError("the database went away"))
        return failed

    monkeypatch.setattr(gw.state.usage, "submit", lost)
    with pytest.raises(anthropic.OverloadedError, match="Usage could not be recorded"):
        await c.messages.create(model="fake-model", max_tokens=4, messages=say("hi"))
    body = {"model": "fake-model", "max_tokens": 4, "messages": say("hi"), "stream": True}
    async with gw.http.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": key}) as r:
        raw = await r.text()
    assert r.status == 200 and "event: content_block_delta" in raw
    # the text went out, but no message_delta or message_stop: the client knows it failed
    assert raw.rstrip().split("\n\n")[-1].startswith("event: error")
    assert "message_stop" not in raw and "Usage could not be recorded" in raw


def test_free_calls_become_tool_use_blocks_and_at_most_one_without_parallel_calls():
    """The reply of a model that calls tools (in the <tool_call> form the gateway asks
    for), whole and streamed in small pieces: content blocks in order, the calls'
    inputs as JSON, and with disable_parallel_tool_use only the first call."""
    calls = ["Oslo", "Lima"]
    text = "Sure." + "".join(
        f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}</tool_call>'
        for c in calls
    )
    for parallel, expected in ((True, calls), (False, calls[:1])):
        plan = ToolPlan("auto", {"get_weather": TOOL["input_schema"]}, None, parallel)
        output, whole = ChoiceOutput(plan, NO_PARSERS), Whole()
        whole.add(output.feed(GenChunk([], text)))
        whole.add(output.finish("stop")[0])
        blocks, called = reply_content(whole)
        assert called and blocks[0] == {"type": "text", "text": "Sure."}
        assert [b["input"] for b in blocks[1:]] == [{"city": c} for c in expected]
        assert all(b["id"].startswith("toolu_") for b in blocks[1:])
        events = MessageEvents(ChoiceOutput(plan, NO_PARSERS))
        out = [
            e for i in range(0, len(text), 5) for e in events.feed(GenChunk([], text[i : i + 5]))
        ]
        rest, finish = events.finish("stop")
        out += rest
        assert finish == "tool_calls"
        starts = [d["content_block"] for name, d in out if name == "content_block_start"]
        assert [b["type"] for b in starts] == ["text"] + ["tool_use"] * len(expected)
        assert [d["index"] for name, d in out if name == "content_block_stop"] == list(
            range(len(starts))
        )
        deltas = [d for name, d in out if name == "content_block_delta"]
        assert "".join(d["delta"]["text"] for d in deltas if "text" in d["delta"]) == "Sure."
        fragments: dict[int, str] = {}  # each block's JSON, streamed as the parser reads it
        for d in deltas:
            if d["delta"]["type"] == "input_json_delta":
                fragments[d["index"]] = fragments.get(d["index"], "") + d["delta"]["partial_json"]
        inputs = [json.loads(f) for f in fragments.values()]
        assert inputs == [{"city": c} for c in expected]
