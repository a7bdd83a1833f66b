"""Graceful drain (gateway/http/drain.py) of real `kvgate serve` processes: on SIGTERM
/ready turns 503 while /health stays 200, a new request gets 503 with Retry-After in its
API's shape, the streams in flight finish whole with their usage rows, a stream still
open at --drain-timeout ends with an error event in its API's shape (billed for what it
delivered), and the process exits 0; `serve --workers` drains through its workers,
which then exit 0. And a worker's own drain, in process: its stream cut at the
deadline ends with an error line.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sqlite3
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from gateway.backends import BackendSpec, build_backends
from gateway.config import Settings
from gateway.http.server import GatewayTestServer
from gateway.worker.app import create_worker_app
from gateway.worker.state import WorkerState
from tests.conftest import start_gateway
from tests.gateway.test_worker import gen_body

MODEL = "m-slow"
STREAMS = 20
TOKENS = 16  # at 10 tokens/s: each stream still runs for a second or more after SIGTERM
CONFIG = f"""
[[backends]]
name = "slow"
type = "fake"
model = "{MODEL}"
options = {{ tokens_per_second = 10 }}
"""
CHAT = [{"role": "user", "content": "hello"}]


class Started:
    """Set once `want` streams have each received their first piece."""

    def __init__(self, want: int) -> None:
        self.want, self.seen, self.all = want, 0, asyncio.Event()

    def one(self) -> None:
        self.seen += 1
        if self.seen == self.want:
            self.all.set()


async def _stream(client: openai.AsyncOpenAI, tokens: int, started: Started):
    """A chat stream read to its end: (its finish reason, its usage, pieces received)."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    finish, usage, pieces = None, None, 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
            if pieces == 1:
                started.one()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    return finish, usage, pieces


async def _anthropic_stream(claude: anthropic.AsyncAnthropic, started: Started) -> None:
    """An Anthropic Messages stream of 1000 tokens (100 s), read until it fails."""
    async with claude.messages.stream(model=MODEL, max_tokens=1000, messages=CHAT) as stream:
        pieces = 0
        async for _ in stream.text_stream:
            pieces += 1
            if pieces == 1:
                started.one()


def _rows(db: Path) -> list[tuple[int, int]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT status, completion_tokens FROM usage_records").fetchall()


async def _refused_while_draining(gw, key: str) -> None:
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        ready = await http.get("/ready")
        assert ready.status_code == 503 and ready.json()["draining"] is True
        assert (await http.get("/health")).status_code == 200
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
        chat = await http.post("/v1/chat/completions", json=body, headers=auth)
        assert chat.status_code == 503 and chat.headers["Retry-After"] == "1"
        assert chat.json()["error"]["code"] == "shutting_down"
        answer = await http.post(
            "/v1/responses", json={"model": MODEL, "input": "hi"}, headers=auth
        )
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
    # Anthropic's shape and status for "come back later": 529 overloaded_error
    claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as refused:
        await claude.messages.create(model=MODEL, max_tokens=2, messages=CHAT)
    assert refused.value.status_code == 529
    assert refused.value.body["error"]["type"] == "overloaded_error"
    assert refused.value.response.headers["retry-after"] == "1"


async def test_sigterm_drains_streams_then_cuts_the_long_ones(tmp_path):
    gw = start_gateway(tmp_path, "--drain-timeout", "5", config=CONFIG)
    try:
        _, key = gw.tenant_key("acme")
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
        started = Started(STREAMS + 2)
        short = [asyncio.create_task(_stream(client, TOKENS, started)) for _ in range(STREAMS)]
        long = asyncio.create_task(_stream(client, 1000, started))  # 100 s: cut
        long_claude = asyncio.create_task(_anthropic_stream(claude, started))  # cut too
        await asyncio.wait_for(started.all.wait(), 60)  # every stream is under way
        gw.proc.send_signal(signal.SIGTERM)
        await _refused_while_draining(gw, key)
        for finish, usage, pieces in await asyncio.gather(*short):
            assert finish == "length" and usage.completion_tokens == TOKENS == pieces
        with pytest.raises(openai.APIError, match="shut down before this request finished"):
            await long
        with pytest.raises(anthropic.APIError, match="shut down before this request finished"):
            await long_claude  # Anthropic's error event
        assert await asyncio.to_thread(gw.proc.wait, 60) == 0
    finally:
        gw.stop()
    rows = _rows(tmp_path / "kvgate.db")
    assert sorted(status for status, _ in rows) == [200] * STREAMS + [503] * 2
    for tokens in [tokens for status, tokens in rows if status == 503]:
        assert TOKENS < tokens < 1000  # billed for what it delivered before the cut


def test_serve_workers_drains_through_its_workers(tmp_path):
    gw = start_gateway(tmp_path, "--workers", "2", config=CONFIG, timeout=120)
    try:
        _, key = gw.tenant_key("acme")

        async def run() -> list:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
            started = Started(4)
            tasks = [asyncio.create_task(_stream(client, TOKENS, started)) for _ in range(4)]
            await asyncio.wait_for(started.all.wait(), 60)
            gw.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

        for finish, usage, _ in asyncio.run(run()):
            assert finish == "length" and usage.completion_tokens == TOKENS
        assert gw.proc.wait(60) == 0
    finally:
        gw.stop()
    # stopped after the gateway's drain, each worker drained and exited 0
    ends = re.findall(r"worker (\d) \(pid \d+\) exited \((-?\d+)\)", gw.log.read_text())
    assert sorted(ends) == [("0", "0"), ("1", "0")]
    assert [s for s, _ in _rows(tmp_path / "kvgate.db")] == [200] * 4


async def test_worker_drain_cuts_its_stream_with_an_error_line():
    spec = BackendSpec("slow", "fake", MODEL, "", {"tokens_per_second": 20})
    settings = Settings(backend="fake")
    state = WorkerState(settings, build_backends(spec)[0], "fake", None)
    server = GatewayTestServer(create_worker_app(state), settings)
    await server.start_server()
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url("")), timeout=30) as http:
            body = gen_body([1001, 1002], 500) | {"model": MODEL}
            async with http.stream("POST", "/kvgate/v1/generate", json=body) as r:
                lines = aiter(r.aiter_lines())
                first = json.loads(await anext(lines))
                assert first["token_ids"]
                drained = asyncio.create_task(state.drain.run(0.2))
                await asyncio.sleep(0)  # the drain has begun
                assert (await http.get("/ready")).status_code == 503
                refused = await http.post("/kvgate/v1/generate", json=body)
                assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
                rest = [json.loads(line) async for line in lines if line]
            assert await drained == 1
            assert rest[-1]["error"]["code"] == "shutting_down"
            assert len(rest) < 500
    finally:
        await server.close()
