"""A remote upstream that parses its own replies (vLLM or SGLang started with a reasoning
parser and a tool-call parser) behind a real `kvgate serve`: its `reasoning_content` and
`tool_calls` deltas pass through into chat's, Anthropic's and the Responses API's shapes,
whole and streamed, with the real `openai` and `anthropic` clients, and are metered."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
from aiohttp import web

from tests.conftest import LiveGateway, free_port, start_gateway
from tests.gateway.test_url_only_upstreams import url_only, wait_for_rows

MODEL = "parsed"
REASONING = ["The user wants ", "the weather; ", "I will call the tool."]
ARGUMENTS = ['{"city": ', '"Oslo"}']
COMPLETION_TOKENS = 12  # the upstream's count: its chunks are fewer (reasoning, calls)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


class ParsingUpstream:
    """vLLM's streamed chat answer with --reasoning-parser and --tool-call-parser on: the
    reasoning in `reasoning_content` deltas, then one call's id and name, then its
    arguments in fragments, finish_reason "tool_calls", and usage."""

    def __init__(self) -> None:
        self.port = free_port()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        deltas: list[dict] = [{"role": "assistant", "content": ""}]
        deltas += [{"reasoning_content": r} for r in REASONING]
        first = {"index": 0, "id": "chatcmpl-tool-1", "type": "function"}
        deltas.append({"tool_calls": [first | {"function": {"name": "get_weather"}}]})
        deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": a}}]} for a in ARGUMENTS]
        for i, delta in enumerate(deltas):
            finish = "tool_calls" if i == len(deltas) - 1 else None
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": 9, "completion_tokens": COMPLETION_TOKENS}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def __aenter__(self) -> ParsingUpstream:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


async def test_an_upstreams_reasoning_and_calls_pass_through_every_api(tmp_path):
    async with ParsingUpstream() as up:
        url = f"http://127.0.0.1:{up.port}/v1"
        gw = await asyncio.to_thread(start_gateway, tmp_path, config=url_only(url, MODEL))
        try:
            await _every_api(gw, tmp_path)
        finally:
            await asyncio.to_thread(gw.stop)


async def _every_api(gw: LiveGateway, tmp_path) -> None:
    tenant, key = await asyncio.to_thread(gw.tenant_key, "acme")
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    reasoning, arguments = "".join(REASONING), "".join(ARGUMENTS)
    reply = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    message = reply.choices[0].message
    assert message.reasoning == message.reasoning_content == reasoning  # type: ignore[attr-defined]
    [call] = message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.usage.completion_tokens == COMPLETION_TOKENS  # the upstream's claim, taken
    assert 0 < reply.usage.completion_tokens_details.reasoning_tokens < COMPLETION_TOKENS

    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], stream=True
    )
    thought, args, names = [], [], []
    async for chunk in stream:
        delta = chunk.choices[0].delta
        thought.append(getattr(delta, "reasoning_content", None) or "")
        for c in delta.tool_calls or []:
            names.append(c.function.name)
            args.append(c.function.arguments or "")
    assert "".join(thought) == reasoning and "".join(args) == arguments
    assert [n for n in names if n] == ["get_weather"]

    claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    asked = {"model": MODEL, "max_tokens": 64, "messages": ASK, "tools": [tool]}
    whole = await claude.messages.create(**asked)
    async with claude.messages.stream(**asked) as streamed:
        final = await streamed.get_final_message()
    for msg in (whole, final):
        thinking, use = msg.content
        assert thinking.type == "thinking" and thinking.thinking == reasoning
        assert use.type == "tool_use" and use.input == {"city": "Oslo"}
        assert msg.stop_reason == "tool_use"
    assert whole.content[0].signature == final.content[0].signature

    response = await client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER["function"] | {"type": "function"}]
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == reasoning
    assert response.output[1].arguments == arguments
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    rows = await asyncio.to_thread(wait_for_rows, tmp_path, tenant["id"], 5)
    assert all(row[1] == COMPLETION_TOKENS for row in rows)  # billed as the upstream counted
