"""POST /v1/responses on the fake backend, with the `openai` SDK's `client.responses` as
the caller: whole and streamed answers as the SDK reads them and as /openapi.json
describes them, input items and tools translated to the chat path, the stateless
refusals by name, errors, quotas (rpm exact), usage rows and spend.

The fake backend writes words and cannot constrain its output: what a real engine does
with forced tools and JSON schemas is in test_responses_api_engines.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema_rs
import openai
import pytest
from openai import AsyncOpenAI
from sqlalchemy import select

from gateway.backends import BackendSpec, GenChunk
from gateway.db import UsageRecord
from gateway.schemas.responses_api import ResponseCreateRequest
from gateway.serving.parsed_output import ChoiceOutput
from gateway.serving.parser_choice import NONE as NO_PARSERS
from gateway.serving.responses_events import ResponseEvents
from gateway.serving.tool_calls import ToolPlan
from tests.conftest import away_from_minute_boundary
from tests.gateway.test_spend import PRICES, expected_nanos

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 5,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.incomplete",  # the fake writes until max_output_tokens
]


@pytest.fixture
async def gateway(make_gateway):
    backends = [
        BackendSpec("fake", "fake", "", "fake-model", {}),
        BackendSpec("broken", "fake", "", "broken-model", {"fail_rate": 1.0}),
        BackendSpec("slow", "fake", "", "slow-model", {"tokens_per_second": 50}),
    ]
    return await make_gateway(backends, prices={"fake-model": PRICES})


def client(gw, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def rows(gw) -> dict[str, UsageRecord]:
    async with gw.state.db.session() as s:
        return {r.request_id: r for r in (await s.scalars(select(UsageRecord))).all()}


def validator(doc: dict, schema: dict) -> jsonschema_rs.Validator:
    return jsonschema_rs.Draft202012Validator(schema | {"components": doc["components"]})


def parse_sse(raw: str) -> list[tuple[str, dict]]:
    """Each event's name and data."""
    events = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def test_whole_and_streamed_answers_as_the_sdk_and_the_document_say(gateway):
    tenant, key = await gateway.tenant()
    c = client(gateway, key)
    fields = dict(model="fake-model", input="hello there", instructions="Be brief.")
    fields |= dict(max_output_tokens=5, metadata={"ticket": "42"}, user="u-1", temperature=0.5)
    raw = await c.responses.with_raw_response.create(**fields)
    whole = raw.parse()
    assert raw.headers["x-request-id"] == whole.id and whole.id.startswith("resp_")
    assert (whole.object, whole.status, whole.store, whole.model) == (
        "response",
        "incomplete",
        False,
        "fake-model",
    )
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert (whole.metadata, whole.user, whole.temperature) == ({"ticket": "42"}, "u-1", 0.5)
    assert whole.instructions == "Be brief." and whole.max_output_tokens == 5
    (message,) = whole.output
    assert (
        message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    )
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert len(whole.output_text.split()) == 5 == whole.usage.output_tokens
    # "system: Be brief.\nuser: hello there\nassistant:" in the fake's word tokens
    assert whole.usage.input_tokens == 7 and whole.usage.total_tokens == 12
    assert whole.usage.input_tokens_details.cached_tokens == 0
    assert whole.usage.output_tokens_details.reasoning_tokens == 0

    stream = await c.responses.create(**fields, stream=True)
    events = [e async for e in stream]
    assert [e.type for e in events] == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(TEXT_EVENTS)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[9].text == whole.output_text  # the same prompt, the same words
    final = events[-1].response
    assert final.output_text == deltas and final.status == "incomplete"
    assert final.id == events[0].response.id and final.output[0].id == events[2].item.id
    assert final.usage.output_tokens == 5 and final.usage.input_tokens == 7

    # the SDK's stream helper accumulates the same text; an incomplete answer is no
    # `response.completed`, so it has no final response to give
    async with c.responses.stream(**fields) as helper:
        snapshots = [e.snapshot async for e in helper if e.type == "response.output_text.delta"]
        assert snapshots[-1] == deltas
        with pytest.raises(RuntimeError, match="response.completed"):
            await helper.get_final_response()

    recorded = await rows(gateway)
    assert len(recorded) == 3 and recorded[whole.id].completion_tokens == 5
    assert recorded[final.id].prompt_tokens == 7 and recorded[final.id].status == 200
    assert recorded[whole.id].finish_reason == "length" and recorded[whole.id].user == "u-1"
    assert {r.tenant_id for r in recorded.values()} == {tenant["id"]}


async def test_answers_are_as_the_openapi_document_says(gateway):
    _, key = await gateway.tenant()
    async with gateway.http.get(gateway.url + "/openapi.json") as r:
        doc = await r.json()
    op = doc["paths"]["/v1/responses"]["post"]
    ok = op["responses"]["200"]["content"]
    body = {"model": "fake-model", "input": [{"role": "user", "content": "hi"}]}
    body |= {"max_output_tokens": 3, "tools": [WEATHER], "text": {"format": {"type": "text"}}}
    async with await gateway.post("/v1/responses", key, body) as r:
        assert r.status == 200
        validator(doc, ok["application/json"]["schema"]).validate(await r.json())
    async with await gateway.post("/v1/responses", key, body | {"stream": True}) as r:
        assert r.content_type == "text/event-stream"
        events = parse_sse(await r.text())
    each = validator(
        doc, ok["text/event-stream"]["schema"]["properties"]["data"]["else"]["contentSchema"]
    )
    for name, data in events:
        assert name == data["type"]
        each.validate(data)
    assert events[-1][1]["response"]["usage"]["output_tokens"] == 3
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/ResponseCreateRequest"}


HISTORY = [
    {"role": "developer", "content": "Answer in French."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Oslo?"}]},
    {  # an output message sent back as the SDK received it
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
    },
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "-3 C"},
]


async def test_input_items_become_the_chat_they_mean(gateway):
    body = {"model": "m", "instructions": "Be brief.", "input": HISTORY, "tools": [WEATHER]}
    chat = ResponseCreateRequest.model_validate_json(json.dumps(body)).chat()
    assert [m.as_dict() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Oslo?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C", "name": "get_weather"},
    ]
    assert chat.tools[0].function.name == "get_weather" and chat.tool_mode == "auto"
    # through the gateway, the prompt is the chat's prompt, token for token
    _, key = await gateway.tenant()
    c = client(gateway, key)
    done = await c.responses.create(model="fake-model", input=HISTORY, max_output_tokens=2)
    messages = [m.as_dict() for m in chat.messages[1:]]
    same = await c.chat.completions.create(model="fake-model", messages=messages, max_tokens=2)
    assert done.usage.input_tokens == same.usage.prompt_tokens


def test_a_streamed_auto_tool_call_becomes_a_function_call_item():
    """The fake never writes a call: the events of one, from the chat path's Pieces, as a
    model's reply would give them."""
    plan = ToolPlan("auto", {"get_weather": WEATHER["parameters"]})
    output, events = ChoiceOutput(plan, NO_PARSERS), ResponseEvents("resp_1", 0, "m", {})
    sent = [events.start()]
    for piece in [
        "Checking. <tool",
        '_call>{"name": "get_weather", ',
        '"arguments": {"city": "Oslo"}}</tool_',
        "call>",
    ]:
        sent.append(events.delta(output.feed(GenChunk([], piece))))
    rest, finish = output.finish("stop")
    sent += [events.delta(rest), events.finish(finish, {"output_tokens": 9})]
    parsed = parse_sse(b"".join(sent).decode())
    assert [n for n, _ in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in parsed] == list(range(13))
    final = parsed[-1][1]["response"]
    text, call = final["output"]
    assert finish == "tool_calls" and final["status"] == "completed"
    assert text["content"][0]["text"] == "Checking. " and text["status"] == "completed"
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call",
        "get_weather",
        {"city": "Oslo"},
    )
    assert call["call_id"].startswith("call_") and call["id"] == parsed[8][1]["item"]["id"]
    assert parsed[8][1]["output_index"] == 1 and parsed[10][1]["arguments"] == call["arguments"]


REFUSED = [
    ({"store": True}, "'store': true is not supported: kvgate's Responses API is stateless"),
    ({"previous_response_id": "resp_1"}, "'previous_response_id' is not supported"),
    ({"conversation": "conv_1"}, "'conversation' is not supported"),
    ({"background": True}, "'background': true is not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools of type 'web_search' are not supported"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "'file_search'"),
    (
        {"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
        "'code_interpreter'",
    ),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools of type 'mcp'"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice of type 'web_search_preview'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "'item_reference' are not supported"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "'computer_call_output'"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
        "content parts of type 'input_file' are not supported",
    ),
    (  # images are taken (tests/gateway/test_images.py), not by a model without vision
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "`fake-model` does not take images",
    ),
    ({"reasoning": {"effort": "low"}}, "'reasoning'"),
    ({"include": ["message.output_text.logprobs"]}, "'include'"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "'verbosity'"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
        "'x', which is not in tools",
    ),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "needs name and schema"),
    (
        {
            "tools": [WEATHER],
            "tool_choice": "required",
            "text": {"format": {"type": "json_object"}},
        },
        "cannot be combined",
    ),
    ({"input": ""}, "input"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
]


async def test_stateless_and_unsupported_fields_are_refused_by_name(gateway):
    tenant, key = await gateway.tenant(rpm=1)
    c = client(gateway, key)
    base = {"model": "fake-model", "input": "hi", "max_output_tokens": 2}
    for fields, words in REFUSED:
        with pytest.raises(openai.BadRequestError) as e:
            await c.responses.create(**{**base, **fields})
        assert words in e.value.body["message"], (fields, e.value.body)
        assert e.value.body["type"] == "invalid_request_error"
    # the fake cannot constrain its output: a forced call or a JSON schema is its 400
    for fields in (
        {"tools": [WEATHER], "tool_choice": "required"},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}},
        {"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}},
    ):
        with pytest.raises(openai.BadRequestError, match="cannot constrain its output"):
            await c.responses.create(**base, **fields)
    # none of it was billed or counted: the one request a minute rpm allows still passes
    await away_from_minute_boundary()
    assert await rows(gateway) == {}
    # null asks for the default: no state, no temperature of its own
    done = await c.responses.create(
        **base, store=False, previous_response_id=None, temperature=None
    )
    assert done.temperature == 1.0
    assert done.store is False and done.usage.output_tokens == 2
    assert [r.tenant_id for r in (await rows(gateway)).values()] == [tenant["id"]]


async def test_errors_in_openais_shape(gateway):
    _, key = await gateway.tenant()
    c = client(gateway, key)
    with pytest.raises(openai.AuthenticationError):
        await client(gateway, "kvg-wrong").responses.create(model="fake-model", input="hi")
    with pytest.raises(openai.NotFoundError) as e:
        await c.responses.create(model="nope", input="hi")
    assert e.value.body["code"] == "model_not_found"
    # a backend that fails: a whole answer is a 503 and bills nothing
    with pytest.raises(openai.InternalServerError) as e:
        await c.responses.create(model="broken-model", input="hi", max_output_tokens=3)
    assert e.value.status_code == 503 and "broken failed the request" in e.value.body["message"]
    # streamed, the failure after the 200 is `response.failed`, with what was sent
    stream = await c.responses.create(
        model="broken-model", input="hi", max_output_tokens=3, stream=True
    )
    events = [e async for e in stream]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "broken failed the request" in failed.error.message and failed.output == []
    recorded = sorted((await rows(gateway)).values(), key=lambda r: r.id)
    assert [(r.status, r.completion_tokens, r.prompt_tokens) for r in recorded] == [(503, 0, 0)] * 2
    assert recorded[1].request_id == failed.id


async def test_rpm_is_exact_and_rows_and_spend_match_the_answers(gateway):
    tenant, key = await gateway.tenant(rpm=4)
    c = client(gateway, key)
    await away_from_minute_boundary()
    started = time.time() // 60

    async def one(i: int):
        try:
            if i % 2:
                stream = await c.responses.create(
                    model="fake-model", input=f"question {i}", max_output_tokens=3, stream=True
                )
                return [e async for e in stream][-1].response
            return await c.responses.create(
                model="fake-model", input=f"question {i}", max_output_tokens=3
            )
        except openai.RateLimitError as e:
            return e

    results = await asyncio.gather(*(one(i) for i in range(7)))
    assert time.time() // 60 == started  # one window
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    answered = [r for r in results if not isinstance(r, openai.RateLimitError)]
    assert len(answered) == 4 and len(refused) == 3
    assert all(r.body["code"] == "rate_limit_exceeded" for r in refused)
    assert all(int(r.response.headers["Retry-After"]) >= 1 for r in refused)
    recorded = await rows(gateway)
    assert set(recorded) == {a.id for a in answered}
    for a in answered:
        row, u = recorded[a.id], a.usage
        assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (
            u.input_tokens,
            u.output_tokens,
            u.input_tokens_details.cached_tokens,
        )
        cached = u.input_tokens_details.cached_tokens
        assert (
            row.spend_nano_usd
            == expected_nanos(PRICES, u.input_tokens, cached, u.output_tokens)
            > 0
        )
    status, usage = await gateway.admin("GET", f"/admin/usage?tenant_id={tenant['id']}")
    assert status == 200 and usage["total"]["requests"] == 4


async def test_a_client_that_hangs_up_is_billed_for_what_it_received(gateway):
    tenant, key = await gateway.tenant(max_concurrent=1)
    c = client(gateway, key)
    stream = await c.responses.create(
        model="slow-model", input="hello there", max_output_tokens=200, stream=True
    )
    deltas = 0
    async for event in stream:
        deltas += event.type == "response.output_text.delta"
        if deltas == 3:
            break
    await stream.close()
    deadline = time.monotonic() + 30
    while not (recorded := await rows(gateway)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    (row,) = recorded.values()
    assert row.status == 499 and 3 <= row.completion_tokens < 200 and row.prompt_tokens == 4
    quota = await gateway.state.quota.used(tenant["id"], time.time())
    assert quota["daily"] == row.prompt_tokens + row.completion_tokens
    assert quota["concurrent"] == 0
    # the slot is back: the next request is admitted, and billed on its own row
    done = await c.responses.create(model="slow-model", input="hi", max_output_tokens=2)
    assert len(await rows(gateway)) == 2 and done.usage.output_tokens == 2
