"""Structured outputs and tool calls through the gateway, with the openai client, on the
gpu engine serving a tiny random model (its free output is noise): what comes back
parses and validates because the engine's grammar allowed nothing else."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from gateway.backends import BackendSpec
from tests.backend_gpu.byte_tokens import save_byte_token_model

SCHEMAS = [
    {  # nested objects, required fields, a bounded string
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["id"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "owner"],
        "additionalProperties": False,
    },
    {  # arrays of enums, booleans
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "done": {"type": "boolean"},
        },
        "required": ["colors", "done"],
        "additionalProperties": False,
    },
    {  # numbers with bounds
        "type": "object",
        "properties": {
            "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
            "grade": {"enum": [1, 2, 3]},
        },
        "required": ["celsius", "grade"],
        "additionalProperties": False,
    },
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time."}}
MESSAGES = [{"role": "user", "content": "Answer in JSON, please."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_byte_token_model("llama", str(tmp_path_factory.mktemp("structured")))


@pytest.fixture
async def gateway(make_gateway, model_dir):
    options = {"max_num_batched_tokens": 128, "seed": 1}
    gw = await make_gateway([BackendSpec("tiny", "gpu", model_dir, "tiny", options)])
    _, key = await gw.tenant("acme")
    return gw, AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


async def test_json_schemas_always_validate_on_chat_and_completions(gateway):
    _, client = gateway
    for schema in SCHEMAS:
        reply = await client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=120,
            n=3,
            seed=7,
            response_format=response_format(schema),
        )
        for choice in reply.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), schema)
        text = await client.completions.create(
            model="tiny",
            prompt="JSON:",
            max_tokens=120,
            n=2,
            seed=3,
            extra_body={"guided_json": schema},
        )
        for choice in text.choices:
            jsonschema.validate(json.loads(choice.text), schema)
        assert reply.usage.completion_tokens > 0


async def test_json_mode_choice_and_regex(gateway):
    _, client = gateway
    reply = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=120,
        seed=2,
        n=3,
        response_format={"type": "json_object"},
    )
    ended = [c for c in reply.choices if c.finish_reason == "stop"]
    # the noise may write one key until max_tokens: what ended is one object
    assert ended and all(isinstance(json.loads(c.message.content), dict) for c in ended)
    choices = ["approve", "reject", "escalate"]
    picked = await client.completions.create(
        model="tiny", prompt="Decision:", max_tokens=10, n=4, extra_body={"guided_choice": choices}
    )
    assert all(c.text in choices for c in picked.choices)
    zips = await client.completions.create(
        model="tiny", prompt="Zip:", max_tokens=10, extra_body={"guided_regex": "[0-9]{5}"}
    )
    assert len(zips.choices[0].text) == 5 and zips.choices[0].text.isdigit()


async def test_a_named_tool_call_has_valid_arguments_streamed_and_not(gateway):
    _, client = gateway
    named = {"type": "function", "function": {"name": "get_weather"}}
    fields = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=60)
    reply = await client.chat.completions.create(**fields, tool_choice=named)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = await client.chat.completions.create(**fields, tool_choice=named, stream=True)
    pieces, finish, ids = [], None, set()
    async for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            if tc.id:
                ids.add(tc.id)
            pieces.append(tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1
    jsonschema.validate(json.loads("".join(pieces)), WEATHER["function"]["parameters"])


async def test_required_tool_calls_parse(gateway):
    _, client = gateway
    reply = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=120,
        parallel_tool_calls=False,
        seed=5,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    else:
        assert call.function.name == "get_time" and arguments == {}


async def test_tool_turns_in_the_history_are_accepted(gateway):
    _, client = gateway
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    }
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": -3}'},
    ]
    reply = await client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


async def test_constrained_and_free_requests_in_one_batch(gateway):
    gw, client = gateway
    free = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    alone = (await client.completions.create(**free)).choices[0].text
    schema = SCHEMAS[2]
    constrained = [
        client.completions.create(
            model="tiny", prompt="JSON:", max_tokens=60, seed=s, extra_body={"guided_json": schema}
        )
        for s in range(3)
    ]
    outs = await asyncio.gather(client.completions.create(**free), *constrained)
    assert outs[0].choices[0].text == alone  # the masks stayed in their own rows
    for out in outs[1:]:
        jsonschema.validate(json.loads(out.choices[0].text), schema)
    assert gw.backend("tiny").stats().extra["num_steps"] > 0


async def test_a_schema_that_cannot_compile_is_a_400_and_changes_nothing(gateway):
    gw, client = gateway
    bad = {"type": "string", "format": "not-a-format"}
    with pytest.raises(openai.BadRequestError, match="not-a-format"):
        await client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=response_format(bad)
        )
    with pytest.raises(openai.BadRequestError, match="guided_decoding_backend"):
        await client.completions.create(
            model="tiny", prompt="x", extra_body={"guided_decoding_backend": "outlines"}
        )
    with pytest.raises(openai.BadRequestError, match="at most one structured output"):
        await client.completions.create(
            model="tiny", prompt="x", extra_body={"guided_regex": "a", "guided_choice": ["b"]}
        )
    status, usage = await gw.admin("GET", "/admin/usage")
    assert status == 200 and usage["total"]["requests"] == 0  # no row, no quota taken
    stats = gw.backend("tiny").stats()
    assert stats.running == stats.waiting == 0
    assert stats.extra["num_free_blocks"] == stats.extra["num_blocks"]
