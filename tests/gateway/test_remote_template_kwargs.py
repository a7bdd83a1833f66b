"""A request's chat_template_kwargs reach a remote upstream that renders the chat
(issue 48): vLLM and SGLang take them on /tokenize and /v1/chat/completions (Qwen3's
`enable_thinking: false` turns its thinking off there, as it does on the gateway's own
engines). Two real upstream servers in front of the gateway: one with vLLM's /tokenize
(the gateway renders through it, then sends token ids), and one that tells nothing
(tests.gateway.test_url_only_upstreams' BareUpstream: the chat goes as text, with its
variables). Anthropic's `thinking: disabled` arrives as the same variable."""

from __future__ import annotations

import json

import anthropic
import openai
from aiohttp import web

from gateway.backends import BackendSpec
from tests.conftest import free_port
from tests.gateway.test_url_only_upstreams import UPSTREAM_ID, BareUpstream

MODEL = "qwen"
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
OFF = {"enable_thinking": False}


class TokenizingUpstream:
    """vLLM's shape: /v1/models (with max_model_len), /tokenize of a chat through its
    template (here: a token per message, and four more for the empty think block Qwen3's
    template writes when enable_thinking is false), and streamed /v1/completions."""

    def __init__(self) -> None:
        self.port = free_port()
        self.tokenized: list[dict] = []
        self.prompts: list[list[int]] = []

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": UPSTREAM_ID, "max_model_len": 4096}]
        return web.json_response({"object": "list", "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" not in body:  # the probe at start, or a count
            return web.json_response({"tokens": [7] * len(body.get("prompt", "")), "count": 1})
        self.tokenized.append(body)
        tokens = [1] * len(body["messages"])
        if body.get("chat_template_kwargs", {}).get("enable_thinking") is False:
            tokens += [2, 3, 4, 5]
        return web.json_response({"tokens": tokens, "count": len(tokens)})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        choice = {"index": 0, "text": "Cold.", "finish_reason": "stop"}
        await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def __aenter__(self) -> TokenizingUpstream:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


async def clients(make_gateway, url: str) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    gw = await make_gateway([BackendSpec("up", "remote", MODEL, MODEL, {"urls": [url]})])
    _, key = await gw.tenant("acme")
    return (
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0),
        anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0),
    )


async def test_the_upstreams_tokenize_renders_with_them(make_gateway):
    async with TokenizingUpstream() as up:
        client, claude = await clients(make_gateway, f"http://127.0.0.1:{up.port}/v1")
        plain = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
        assert "chat_template_kwargs" not in up.tokenized[-1]
        off = await client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, extra_body={"chat_template_kwargs": OFF}
        )
        assert up.tokenized[-1]["chat_template_kwargs"] == OFF
        # the prompt sent and billed is the one rendered with them
        assert up.prompts[-1] == [1, 2, 3, 4, 5] and off.usage.prompt_tokens == 5
        assert plain.usage.prompt_tokens == 1 and off.choices[0].message.content == "Cold."
        await claude.messages.create(
            model=MODEL, messages=ASK, max_tokens=4, thinking={"type": "disabled"}
        )
        assert up.tokenized[-1]["chat_template_kwargs"] == OFF


async def test_a_chat_sent_as_text_carries_them(make_gateway):
    async with BareUpstream() as up:
        client, _ = await clients(make_gateway, up.url)
        await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
        assert "chat_template_kwargs" not in up.bodies[-1]
        kwargs = {"enable_thinking": False, "reasoning_effort": "low"}
        reply = await client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=2, extra_body={"chat_template_kwargs": kwargs}
        )
        sent = up.bodies[-1]
        assert sent["chat_template_kwargs"] == kwargs and sent["messages"] == ASK
        assert reply.choices[0].message.content == "Hello there"
