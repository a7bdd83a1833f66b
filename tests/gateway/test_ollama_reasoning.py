"""A reply's reasoning and tool calls in Ollama's shape: a remote upstream that parses its
own replies (tests/gateway/test_reasoning_remote.py's, vLLM's streamed answer with a
reasoning and a tool-call parser) behind a real `kvgate serve`, the `ollama` client on
/api/chat whole and streamed: the reasoning in `message.thinking`, the call whole with
its arguments as an object, each request one usage row billed as the upstream counted."""

from __future__ import annotations

import asyncio

import ollama

from tests.conftest import start_gateway
from tests.gateway.test_reasoning_remote import (
    ASK,
    COMPLETION_TOKENS,
    MODEL,
    REASONING,
    WEATHER,
    ParsingUpstream,
)
from tests.gateway.test_url_only_upstreams import url_only, wait_for_rows

CALL = {"name": "get_weather", "arguments": {"city": "Oslo"}}


async def test_thinking_and_tool_calls_in_ollamas_shape(tmp_path):
    async with ParsingUpstream() as up:
        url = f"http://127.0.0.1:{up.port}/v1"
        gw = await asyncio.to_thread(start_gateway, tmp_path, config=url_only(url, MODEL))
        try:
            tenant, key = await asyncio.to_thread(gw.tenant_key, "acme")
            auth = {"Authorization": f"Bearer {key}"}
            client = ollama.AsyncClient(host=gw.url, headers=auth)
            whole = await client.chat(MODEL, ASK, tools=[WEATHER], stream=False)
            assert whole.message.thinking == "".join(REASONING)
            [call] = whole.message.tool_calls
            assert (call.function.name, dict(call.function.arguments)) == tuple(CALL.values())
            assert whole.done_reason == "stop" and whole.eval_count == COMPLETION_TOKENS

            parts = [p async for p in await client.chat(MODEL, ASK, tools=[WEATHER], stream=True)]
            assert "".join(p.message.thinking or "" for p in parts) == "".join(REASONING)
            calls = [c for p in parts for c in p.message.tool_calls or []]
            assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
                tuple(CALL.values())
            ]
            assert parts[-1].done and not any(p.done for p in parts[:-1])
            rows = await asyncio.to_thread(wait_for_rows, tmp_path, tenant["id"], 2)
            assert [row[1] for row in rows] == [COMPLETION_TOKENS] * 2
        finally:
            await asyncio.to_thread(gw.stop)
