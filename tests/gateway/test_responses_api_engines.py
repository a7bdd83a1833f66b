"""POST /v1/responses on real engines, the `openai` SDK's `client.responses` as the caller:
the gpu engine (a tiny random model, on the CPU), the llama.cpp engine (the default
model) and a third-party upstream (llama-cpp-python's server), whole and streamed. On the
gpu engine a forced tool call's arguments and a `text.format` JSON schema's output
validate against their schemas whatever the noise the model writes, streamed or not:
the engine's grammar allowed nothing else.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from gateway.backends import BackendSpec
from gateway.backends.default_model import default_model_path
from tests.backend_gpu.byte_tokens import save_byte_token_model
from tests.conftest import away_from_minute_boundary
from tests.gateway.test_remote import (  # noqa: F401 (llama_*: the upstream's fixtures)
    MODEL,
    llama_gateway,
    llama_server,
    usage_rows,
)

WEATHER = {
    "type": "function",
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
    "strict": True,
}
# no arguments, and no room for the noise to write any
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
CLOCK = {"type": "function", "name": "get_time", "parameters": NO_ARGUMENTS, "strict": False}


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_byte_token_model("llama", str(tmp_path_factory.mktemp("responses")))


@pytest.fixture
async def tiny(make_gateway, model_dir) -> AsyncOpenAI:
    options = {"max_num_batched_tokens": 128, "seed": 1}
    gw = await make_gateway([BackendSpec("tiny", "gpu", model_dir, "tiny", options)])
    _, key = await gw.tenant("acme")
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def test_gpu_engine_text_whole_and_streamed(tiny):
    whole = await tiny.responses.create(model="tiny", input="Hello", max_output_tokens=6)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert 0 < whole.usage.output_tokens <= 6 and whole.usage.input_tokens > 0
    events = [
        e
        async for e in await tiny.responses.create(
            model="tiny", input="Hello", max_output_tokens=6, stream=True
        )
    ]
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.usage.output_tokens <= 6
    assert events[-1].type == ("response." + final.status)
    assert final.usage.input_tokens == whole.usage.input_tokens


async def test_gpu_engine_forced_tools_validate_whole_and_streamed(tiny):
    named = {"type": "function", "name": "get_weather"}
    fields = dict(model="tiny", input="Weather?", tools=[WEATHER, CLOCK], max_output_tokens=120)
    whole = await tiny.responses.create(**fields, tool_choice=named)
    (call,) = whole.output
    assert whole.status == "completed" and call.type == "function_call"
    assert (
        call.name == "get_weather"
        and call.call_id.startswith("call_")
        and call.status == "completed"
    )
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    async with tiny.responses.stream(**fields, tool_choice=named) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert kinds[-3:-1] == ["response.function_call_arguments.done", "response.output_item.done"]
    (streamed,) = final.output
    jsonschema.validate(
        streamed.parsed_arguments, WEATHER["parameters"]
    )  # strict: the SDK parsed it

    required = await tiny.responses.create(
        **fields, tool_choice="required", parallel_tool_calls=False
    )
    (call,) = required.output
    arguments = json.loads(call.arguments)
    if call.name == "get_weather":
        jsonschema.validate(arguments, WEATHER["parameters"])
    else:
        assert call.name == "get_time" and arguments == {}

    # the call and its output sent back as input items: a next turn
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": -3}'},
    ]
    after = await tiny.responses.create(
        model="tiny", input=history, tools=[WEATHER, CLOCK], max_output_tokens=4
    )
    assert after.usage.input_tokens > required.usage.input_tokens


async def test_gpu_engine_json_schema_format_validates(tiny):
    fields = dict(model="tiny", input="A forecast, as JSON.", max_output_tokens=80)
    parsed = await tiny.responses.parse(**fields, text_format=Forecast)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Forecast)
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Forecast"
    async with tiny.responses.stream(**fields, text_format=Forecast) as stream:
        final = await stream.get_final_response()
    assert isinstance(final.output_parsed, Forecast)
    Forecast.model_validate_json(final.output_text)
    # a schema the grammar engine cannot compile is a 400 before any quota is taken
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "string", "format": "nope"}}
    with pytest.raises(openai.BadRequestError):
        await tiny.responses.create(**fields, text={"format": bad})


@pytest.mark.slow
async def test_llama_cpp_engine_whole_and_streamed(make_gateway):
    options = {"n_ctx": 1024, "n_parallel": 1, "n_batch": 128, "n_threads": 1}
    gw = await make_gateway(
        [BackendSpec("local", "local", str(default_model_path()), "m", options)]
    )
    _, key = await gw.tenant("acme")
    client = AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    fields = dict(model="m", instructions="Answer briefly.", input="What is the capital of France?")
    fields |= dict(max_output_tokens=12, temperature=0)
    whole = await client.responses.create(**fields)
    assert whole.output_text.strip() and "<end_of_turn>" not in whole.output_text
    messages = [{"role": "system", "content": fields["instructions"]}]
    messages.append({"role": "user", "content": fields["input"]})
    chat = await client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    events = [e async for e in await client.responses.create(**fields, stream=True)]
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas.strip() and deltas == final.output_text
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again


@pytest.mark.slow
def test_third_party_upstream_whole_and_streamed(llama_gateway):  # noqa: F811
    gw, tmp = llama_gateway
    tenant, key = gw.tenant_key("responses", rpm=2)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    fields = dict(model=MODEL, input="The capital of France is", max_output_tokens=8, temperature=0)
    asyncio.run(away_from_minute_boundary())  # rpm counts per UTC minute
    whole = client.responses.create(**fields)
    assert whole.output_text.strip() and whole.usage.output_tokens > 0
    with client.responses.stream(**fields) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert deltas.strip() and last.response.output_text == deltas
    assert last.response.usage.input_tokens == whole.usage.input_tokens
    with pytest.raises(openai.RateLimitError):  # rpm 2, exactly
        client.responses.create(**fields)
    rows = usage_rows(tmp, tenant["id"])
    assert [r[2] for r in rows] == [200, 200]
    assert rows[0][:2] == (whole.usage.input_tokens, whole.usage.output_tokens)
    assert rows[1][:2] == (last.response.usage.input_tokens, last.response.usage.output_tokens)
