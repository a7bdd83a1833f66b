"""Anthropic's Messages API on every kind of backend, the `anthropic` SDK as the caller:
the gpu engine on a tiny random model (a forced tool's input validates against its
schema, whole and streamed), the llama.cpp engine on the default model, and remote
upstreams (a `kvgate worker` process; a third-party server that names its stop string
as vLLM does). On each, a stop sequence the engine matched comes
back as stop_reason "stop_sequence" naming it (the engine's own stop-string detection,
carried on its last chunk, over the worker's wire too), and the usage adds up."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from aiohttp import web

from gateway.backends import BackendSpec
from gateway.backends.default_model import DEFAULT_MODEL_ID
from tests.backend_gpu.byte_tokens import save_byte_token_model
from tests.gateway.test_remote import MODEL, gateway_over_workers, usage_rows
from tests.gateway.test_url_only_upstreams import BareUpstream

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
# no extra keys: what the random model writes is bounded
CLOCK = {
    "name": "get_time",
    "input_schema": {"type": "object", "properties": {}, "additionalProperties": False},
}
ASK = [{"role": "user", "content": "Write two sentences about the sea."}]


def client(url: str, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


def a_stop_sequence(text: str) -> str:
    """Three printable ASCII characters of `text` past its start (not all spaces)."""
    for k in range(3, len(text) - 3):
        piece = text[k : k + 3]
        if piece.isascii() and piece.isprintable() and piece.strip():
            return piece
    raise AssertionError(f"no stop sequence to take from {text!r}")


async def check_whole_streamed_and_stopped(gw, model: str) -> None:
    """A greedy reply whole and streamed (the same text), then again with a stop
    sequence taken from its text: it ends where that sequence first stood. Each by a
    tenant of its own: no run reads another's prompt from the cache, so all agree."""
    whole_c, stream_c, c = [client(gw.url, (await gw.tenant(n))[1]) for n in "abc"]
    # greedy; the SDK's 2.x has no temperature argument
    fields = dict(model=model, messages=ASK, max_tokens=24, extra_body={"temperature": 0})
    whole = await whole_c.messages.create(**fields)
    text = whole.content[0].text
    assert whole.usage.output_tokens >= 1 and whole.usage.input_tokens >= 1
    async with stream_c.messages.stream(**fields) as stream:
        streamed = await stream.get_final_message()
    assert streamed.content[0].text == text and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    sequence = a_stop_sequence(text)
    stopped = await c.messages.create(**fields, stop_sequences=[sequence])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", sequence)
    got = "".join(b.text for b in stopped.content)
    assert got == text[: text.index(sequence)]
    counted = await c.messages.count_tokens(model=model, messages=ASK)
    u = stopped.usage
    assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_byte_token_model("llama", str(tmp_path_factory.mktemp("messages")))


async def test_gpu_engine_forced_tools_validate_and_stop_sequences(make_gateway, tiny_dir):
    options = {"max_num_batched_tokens": 128, "seed": 1}
    gw = await make_gateway([BackendSpec("tiny", "gpu", tiny_dir, "tiny", options)])
    await check_whole_streamed_and_stopped(gw, "tiny")
    _, key = await gw.tenant()
    c = client(gw.url, key)

    named = {"type": "tool", "name": "get_weather"}
    fields = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=60)
    reply = await c.messages.create(**fields, tool_choice=named)
    assert reply.stop_reason == "tool_use"
    (call,) = reply.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    async with c.messages.stream(**fields, tool_choice=named) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert "input_json" in kinds  # the SDK's event for each input_json_delta
    (call,) = streamed.content
    assert streamed.stop_reason == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])

    any_one = {"type": "any", "disable_parallel_tool_use": True}
    reply = await c.messages.create(**fields | {"max_tokens": 120}, tool_choice=any_one)
    assert reply.stop_reason == "tool_use"
    (call,) = reply.content
    schema = WEATHER["input_schema"] if call.name == "get_weather" else CLOCK["input_schema"]
    jsonschema.validate(call.input, schema)
    with_tools = await c.messages.count_tokens(model="tiny", messages=ASK, tools=[WEATHER])
    without = await c.messages.count_tokens(model="tiny", messages=ASK)
    assert with_tools.input_tokens > without.input_tokens  # the template shows the tools


@pytest.mark.slow
async def test_llama_cpp_engine_on_the_default_model(make_gateway):
    options = {"n_ctx": 512, "n_parallel": 1, "n_batch": 128, "n_threads": 1}
    gw = await make_gateway([BackendSpec("local", "local", "", "", options)])
    await check_whole_streamed_and_stopped(gw, DEFAULT_MODEL_ID)


async def test_remote_worker_upstream(tmp_path):
    with gateway_over_workers(tmp_path, 1) as (gw, _, _):
        tenant, key = gw.tenant_key("acme", rpm=3)
        c = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)
        fields = dict(model=MODEL, messages=ASK, max_tokens=8)
        whole = c.messages.create(**fields)
        text = whole.content[0].text
        assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 8
        sequence = " " + text.split()[2]
        with c.messages.stream(**fields, stop_sequences=[sequence]) as stream:
            events = [json.loads(e.model_dump_json())["type"] for e in stream]
            stopped = stream.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop"
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", sequence)
        assert stopped.content[0].text == text[: text.index(sequence)]
        with pytest.raises(anthropic.RateLimitError):  # rpm 3: the fourth is refused
            for _ in range(2):
                c.messages.create(**fields)
        rows = usage_rows(tmp_path, tenant["id"])
        assert [r[2] for r in rows] == [200, 200, 200]
        prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
        assert rows[0][:2] == (prompt, 8)
        assert rows[1][1] == stopped.usage.output_tokens


class VllmLikeUpstream(BareUpstream):
    """A third-party upstream that stops at the first stop string it is sent (every
    request here sends one), naming it in its choice's `stop_reason` as vLLM does, or,
    asked for "lie", naming another."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stop = body["stop"][0]
        self.bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        named = "not one it was sent" if stop == "lie" else stop
        chunks = [
            {"index": 0, "delta": {"content": "Hello"}, "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": named},
        ]
        for choice in chunks:
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def test_a_third_party_upstream_names_its_stop_string(make_gateway):
    async with VllmLikeUpstream() as up:
        spec = BackendSpec("up", "remote", "", "vllm", {"urls": [up.url], "context_length": 512})
        gw = await make_gateway([spec])
        _, key = await gw.tenant()
        c = client(gw.url, key)
        fields = dict(model="vllm", messages=ASK, max_tokens=8)
        stopped = await c.messages.create(**fields, stop_sequences=[" there"])
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " there")
        assert stopped.content[0].text == "Hello" and up.bodies[-1]["stop"] == [" there"]
        async with c.messages.stream(**fields, stop_sequences=[" there"]) as stream:
            streamed = await stream.get_final_message()
        assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", " there")
        # a string the request did not give is not taken as one that matched
        lied = await c.messages.create(**fields, stop_sequences=["lie"])
        assert (lied.stop_reason, lied.stop_sequence) == ("end_turn", None)
