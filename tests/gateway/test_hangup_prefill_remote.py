"""A client that hangs up during prefill, through a `type = "remote"` entry: a real
`kvgate worker` process (the gpu engine on a tiny model, prefill in chunks of 8) is
asked to stop the request and says what its engine computed, which the gateway bills,
on every endpoint and for embeddings; a third-party upstream, which cannot say, is
billed the whole prompt once its response has begun, and nothing before.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from aiohttp import web

from gateway.backends import BackendSpec
from tests.backend_gpu.byte_tokens import save_byte_token_model
from tests.backend_gpu.embedding_models import save_tiny_qwen3_embedding
from tests.conftest import free_port
from tests.gateway.test_hangup_prefill import (
    CALLS,
    GPU_PROMPT,
    INPUTS,
    MODEL,
    PRICES,
    Count,
    ask,
    check_embeddings_hang_up,
    check_prefill_hang_up,
    hang_up,
    rows,
    until,
)
from tests.gateway.test_remote import TOKEN, wait_until


def start_worker(tmp: Path, model: str, options: dict, *args: str) -> tuple[subprocess.Popen, int]:
    """A real `kvgate worker` of the gpu engine on the CPU, serving `model` as MODEL."""
    port = free_port()
    log = tmp / f"worker-{port}.log"
    cmd = [sys.executable, "-m", "gateway.cli", "worker", "--port", str(port)]
    cmd += ["--backend", "gpu", "--model", model, "--device", "cpu"]
    cmd += ["--served-model-name", MODEL, "--worker-token", TOKEN]
    cmd += ["--options", json.dumps(options), *args]
    env = os.environ | {"KVGATE_KV_TIER_SECRET": "paired-workers-" + "x" * 24}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(lambda: "listening on" in log.read_text() or proc.poll() is not None, "up")
        assert proc.poll() is None, log.read_text()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, port


@contextlib.contextmanager
def worker(tmp: Path, model: str, options: dict, *args: str) -> Iterator[int]:
    proc, port = start_worker(tmp, model, options, *args)
    try:
        yield port
    finally:
        proc.kill()
        proc.wait()


def worker_count(port: int) -> Count:
    """The worker's engine's count of prompt tokens computed (its /kvgate/v1/stats)."""

    async def count() -> int:
        async with httpx.AsyncClient() as http:
            stats = await http.get(
                f"http://127.0.0.1:{port}/kvgate/v1/stats",
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
        return stats.json()["extra"]["prompt_tokens_total"]

    return count


def remote_spec(url: str, **options: object) -> BackendSpec:
    """A remote entry over `url`; an option given as None is left out."""
    opts = {"url": url, "api_key": TOKEN, "context_length": 2048, "health_interval_s": 0.3}
    opts = {k: v for k, v in (opts | options).items() if v is not None}
    return BackendSpec("up", "remote", MODEL, MODEL, opts)


async def healthy(gw) -> None:
    await until(lambda: all(b.stats().healthy for b in gw.state.backends), "healthy")


@pytest.fixture(scope="module")
def generating_worker(tmp_path_factory) -> Iterator[int]:
    tmp = tmp_path_factory.mktemp("worker")
    with worker(tmp, save_byte_token_model("llama", str(tmp)), {"max_num_batched_tokens": 8}) as p:
        yield p


@pytest.mark.parametrize(("api", "stream"), CALLS)
async def test_a_worker_says_what_it_computed(make_gateway, generating_worker, api, stream):
    url = f"http://127.0.0.1:{generating_worker}/v1"
    gw = await make_gateway([remote_spec(url)], prices=PRICES)
    await healthy(gw)
    await check_prefill_hang_up(gw, worker_count(generating_worker), api, stream, GPU_PROMPT)


async def test_a_worker_says_what_it_embedded(make_gateway, tmp_path):
    model = save_tiny_qwen3_embedding(str(tmp_path / "embed"))
    with worker(tmp_path, model, {"max_num_seqs": 2}) as port:
        spec = remote_spec(f"http://127.0.0.1:{port}/v1", task="embed", context_length=None)
        gw = await make_gateway([spec], prices=PRICES)
        await healthy(gw)
        await check_embeddings_hang_up(gw, worker_count(port), INPUTS)


async def test_a_prefill_worker_says_what_it_computed(make_gateway, tmp_path):
    """Prefill and decode on different workers: a client that leaves while its prompt's
    prefill job runs pays for what the prefill worker computed."""
    model = save_byte_token_model("llama", str(tmp_path))
    options = {"max_num_batched_tokens": 8}
    with (
        worker(tmp_path, model, options, "--role", "prefill") as prefill,
        worker(tmp_path, model, options, "--role", "decode") as decode,
    ):
        specs = [
            dataclasses.replace(remote_spec(f"http://127.0.0.1:{port}/v1"), name=name)
            for name, port in (("prefill", prefill), ("decode", decode))
        ]
        gw = await make_gateway(specs, prices=PRICES, prefill_threshold=64)
        await healthy(gw)
        tenant, key = await gw.tenant("apart")
        count, decoded = worker_count(prefill), worker_count(decode)
        before, decoded_before = await count(), await decoded()
        await hang_up(count, ask(gw, key, "chat", True, GPU_PROMPT))
        (row,) = await until(lambda: rows(gw, tenant["id"]), "the usage row")
        assert row.status == 499 and 0 < row.prompt_tokens == await count() - before
        assert await decoded() == decoded_before  # the decode worker never got it


class SlowUpstream:
    """A third-party OpenAI-compatible server whose streamed /v1/completions begins its
    response (`begins`) or not, then says nothing until the test ends."""

    def __init__(self, begins: bool) -> None:
        self.begins = begins
        self.requests = 0
        self.port = free_port()
        self._end = asyncio.Event()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.json()
        self.requests += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if self.begins:
            await resp.prepare(request)
        await self._end.wait()
        return resp

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        try:
            yield f"http://127.0.0.1:{self.port}/v1"
        finally:
            self._end.set()
            await runner.cleanup()


@pytest.mark.parametrize("begins", [True, False])
async def test_a_third_party_upstream_is_billed_the_prompt_once_it_began(
    make_gateway, tmp_path, begins
):
    upstream = SlowUpstream(begins)
    async with upstream.serving() as url:
        tokenizer = save_byte_token_model("llama", str(tmp_path))
        gw = await make_gateway([remote_spec(url, tokenizer=tokenizer)], prices=PRICES)
        await healthy(gw)
        tenant, key = await gw.tenant("third-party")
        c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        prompt = "Once upon a time, in a land far away, there lived a gateway."
        (replica,) = gw.state.backends

        async def taken() -> int:
            # begun: the gateway has the response and records the prompt as sent there;
            # else it has sent it and waits
            return len(replica.sent.blocks) if begins else upstream.requests

        ask = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True)
        await hang_up(taken, _read_all(ask))
        (row,) = await until(lambda: rows(gw, tenant["id"]), "the usage row")
        counted = await gw.post("/tokenize", key, {"model": MODEL, "prompt": prompt})
        assert row.status == 499 and row.completion_tokens == 0
        assert row.prompt_tokens == ((await counted.json())["count"] if begins else 0)
        used = await gw.state.quota.used(tenant["id"], time.time())
        assert used["daily"] == row.prompt_tokens


async def _read_all(ask) -> None:
    async for _ in await ask:
        pass
