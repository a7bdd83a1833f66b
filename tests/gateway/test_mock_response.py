"""LiteLLM's `mock_response` on the fake backend (issue 48.5): the text a request names is
what the fake backend "generates", cut into tokens and streamed as its words are, on
every API; a model served by any other backend refuses the field by name, in its API's
own error shape."""

from __future__ import annotations

import asyncio

import anthropic
import openai

from gateway.backends import BackendSpec
from tests.gateway.test_remote import MODEL
from tests.gateway.test_remote_faults import FakeUpstream

TEXT = "Hello, <world>! It's 4 o'clock.\n\nBye "
MESSAGES = [{"role": "user", "content": "say it"}]


def _openai(gw, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def test_chat_answers_the_mocked_text(gw):
    _, key = await gw.tenant()
    async with _openai(gw, key) as client:
        reply = await client.chat.completions.create(
            model="fake-model", messages=MESSAGES, extra_body={"mock_response": TEXT}
        )
        choice = reply.choices[0]
        assert (choice.message.content, choice.finish_reason) == (TEXT, "stop")
        # cut as a tokenizer would: words and marks with the whitespace before them
        pieces = ["Hello", ",", " <", "world", ">", "!", " It", "'", "s", " 4", " o", "'"]
        pieces += ["clock", ".", "\n\nBye", " "]
        assert reply.usage.completion_tokens == len(pieces)

        stream = await client.chat.completions.create(
            model="fake-model",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"mock_response": TEXT},
        )
        deltas, finish, usage = [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                deltas.append(c.delta.content or "")
                finish = c.finish_reason or finish
        assert "".join(deltas) == TEXT and finish == "stop"
        assert len([d for d in deltas if d]) > 3  # streamed in pieces, not whole
        assert usage.completion_tokens == len(pieces)


async def test_max_tokens_cuts_the_mocked_text(gw):
    _, key = await gw.tenant()
    async with _openai(gw, key) as client:
        reply = await client.chat.completions.create(
            model="fake-model", messages=MESSAGES, max_tokens=3, extra_body={"mock_response": TEXT}
        )
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Hello, <", "length")
    assert reply.usage.completion_tokens == 3


async def test_empty_mocked_text_ends_at_once(gw):
    _, key = await gw.tenant()
    async with _openai(gw, key) as client:
        reply = await client.chat.completions.create(
            model="fake-model", messages=MESSAGES, extra_body={"mock_response": ""}
        )
    assert reply.choices[0].finish_reason == "stop"
    assert not reply.choices[0].message.content and reply.usage.completion_tokens == 0


async def test_every_api_takes_it(gw):
    _, key = await gw.tenant()
    async with _openai(gw, key) as client:
        done = await client.completions.create(
            model="fake-model", prompt="say it", extra_body={"mock_response": TEXT}
        )
        assert done.choices[0].text == TEXT
        response = await client.responses.create(
            model="fake-model", input="say it", extra_body={"mock_response": TEXT}
        )
        assert response.output_text == TEXT
    claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
    async with claude:
        message = await claude.messages.create(
            model="fake-model",
            max_tokens=100,
            messages=MESSAGES,
            extra_body={"mock_response": TEXT},
        )
    assert [b.text for b in message.content if b.type == "text"] == [TEXT]
    assert message.stop_reason == "end_turn"


async def test_a_mistyped_field_is_a_400(gw):
    _, key = await gw.tenant()
    r = await gw.chat(key, mock_response=5)
    assert r.status == 400
    assert "mock_response" in (await r.json())["error"]["message"]


async def test_only_the_fake_backend_takes_it(make_gateway):
    """A real backend would ignore the field and sample: refused by name, in each API's
    shape, before anything runs."""
    with FakeUpstream("openai") as up:
        options = {"urls": [up.url], "context_length": 4096}
        gw = await make_gateway([BackendSpec("up", "remote", MODEL, options=options)])
        (remote,) = gw.state.backends
        while not remote.stats().healthy:  # the health watch's first answer
            await asyncio.sleep(0.05)
        _, key = await gw.tenant()
        served = up.served
        r = await gw.post(
            "/v1/chat/completions",
            key,
            {"model": MODEL, "messages": MESSAGES, "mock_response": "hi"},
        )
        error = (await r.json())["error"]
        assert r.status == 400 and error["param"] == "mock_response"
        assert "fake backend" in error["message"] and "'up@" in error["message"]
        r = await gw.post(
            "/v1/messages",
            key,
            {"model": MODEL, "max_tokens": 5, "messages": MESSAGES, "mock_response": "hi"},
        )
        body = await r.json()
        assert r.status == 400 and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert "mock_response" in body["error"]["message"]
        assert up.served == served  # nothing reached the upstream
        # max_tokens: unbounded, the fake upstream would write out the whole context
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
        ok = await gw.post("/v1/chat/completions", key, body)
        assert ok.status == 200  # the same request without it is served
