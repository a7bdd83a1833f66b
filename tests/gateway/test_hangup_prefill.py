"""A client that hangs up while its prompt is being prefilled pays for the prompt the
engine computed, on every endpoint and both in-process engines: the gpu engine (a tiny
model on the CPU, its prefill in chunks of 8 tokens) and the llama.cpp engine (the
default GGUF, n_batch 16), each behind a real gateway, the `openai` and `anthropic`
clients as the callers.

A long prompt is sent (streamed and not); once the engine has computed a chunk of it
(its own count of prompt tokens computed says so) the caller leaves. The usage row is a
499 whose prompt tokens are exactly what the engine computed, more than none and less
than the prompt (the work stays in the prefix cache, and was billed 0 before), with the
quota settled to it; the same request again finds no more of its prompt cached than was
billed. Embeddings cut after some of their hundreds of inputs are billed the tokens of
the inputs pooled, as the engine counts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest
from sqlalchemy import select

from gateway.backends import BackendSpec
from gateway.db import UsageRecord
from tests.backend_gpu.byte_tokens import save_byte_token_model
from tests.backend_gpu.embedding_models import save_tiny_qwen3_embedding

MODEL = "m"
PRICES = {MODEL: {"input": 1.0, "output": 2.0}}
MAX_TOKENS = 4
APIS = ["completions", "chat", "messages", "responses"]
CALLS = [(api, stream) for api in APIS for stream in (False, True)]
# a byte a token, mostly, on the tiny model: about 1500 tokens, 190 chunks of 8
GPU_PROMPT = "".join(f"{i % 97:02x}~" for i in range(500))
# a few hundred tokens on the default GGUF: 30-odd decodes of 16
LOCAL_PROMPT = " ".join(f"item {i} of the inventory, colour {i * 7 % 13}." for i in range(60))
INPUTS = [f"input number {i}" for i in range(300)]  # embedded over many steps


async def until(check: Callable[[], Any], what: str) -> Any:
    """`check()`'s first true value (awaited if it is a coroutine), polled for up to two
    minutes (a bound on a broken run, not a measure)."""
    try:
        async with asyncio.timeout(120):
            while True:
                value = check()
                if isinstance(value, Awaitable):
                    value = await value
                if value:
                    return value
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out waiting until {what}") from None


async def ask(gw, key: str, api: str, stream: bool, prompt: str) -> None:
    """One request of `api` for `prompt`, read to its end."""
    if api == "messages":
        claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
        messages = [{"role": "user", "content": prompt}]
        out = await claude.messages.create(
            model=MODEL, max_tokens=MAX_TOKENS, messages=messages, stream=stream
        )
    else:
        c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        if api == "completions":
            out = await c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=stream
            )
        elif api == "chat":
            messages = [{"role": "user", "content": prompt}]
            out = await c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=stream
            )
        else:
            out = await c.responses.create(
                model=MODEL, input=prompt, max_output_tokens=MAX_TOKENS, stream=stream
            )
    if stream:
        async for _ in out:
            pass


# prompt (or embedded) tokens an engine has computed so far, by its own count
Count = Callable[[], Awaitable[int]]


def engine_count(gw, backend: str) -> Count:
    """The in-process engine's count (its stats' prompt_tokens_total)."""

    async def count() -> int:
        return gw.backend(backend).stats().extra["prompt_tokens_total"]

    return count


async def rows(gw, tenant_id: str) -> list[UsageRecord]:
    async with gw.state.db.session() as s:
        query = select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)
        return list((await s.scalars(query.order_by(UsageRecord.id))).all())


async def hang_up(count: Count, request: Awaitable[Any]) -> None:
    """Start `request`; leave once the engine has computed some of it."""
    before = await count()
    task = asyncio.ensure_future(request)

    async def started() -> bool:
        return await count() > before or task.done()

    await until(started, "some of it is computed")
    assert not task.done(), "the request ended before the client could leave"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def check_prefill_hang_up(gw, count: Count, api: str, stream: bool, prompt: str) -> None:
    tenant, key = await gw.tenant(f"{api}-{stream}")
    before = await count()
    await hang_up(count, ask(gw, key, api, stream, prompt))
    (row,) = await until(lambda: rows(gw, tenant["id"]), "the usage row")
    done = await count() - before  # the abort was applied: nothing more comes
    assert (row.status, row.completion_tokens, row.cached_tokens) == (499, 0, 0)
    assert 0 < row.prompt_tokens == done
    assert row.spend_nano_usd > 0
    used = await gw.state.quota.used(tenant["id"], time.time())
    assert used["daily"] == row.prompt_tokens and used["concurrent"] == 0
    # the same request again: its whole prompt, and no more of it cached than was paid
    await ask(gw, key, api, False, prompt)  # its row is committed before its answer
    _, again = await rows(gw, tenant["id"])
    assert again.status == 200 and row.prompt_tokens < again.prompt_tokens
    assert again.cached_tokens <= row.prompt_tokens


@pytest.fixture
async def gpu_gateway(make_gateway, tmp_path):
    model = save_byte_token_model("llama", str(tmp_path))
    options = {"device": "cpu", "max_num_batched_tokens": 8}
    return await make_gateway([BackendSpec("gpu", "gpu", model, MODEL, options)], prices=PRICES)


@pytest.mark.parametrize(("api", "stream"), CALLS)
async def test_the_gpu_engine_bills_the_prompt_it_computed(gpu_gateway, api, stream):
    gw = gpu_gateway
    await check_prefill_hang_up(gw, engine_count(gw, "gpu"), api, stream, GPU_PROMPT)


@pytest.mark.slow
@pytest.mark.parametrize(("api", "stream"), CALLS)
async def test_the_llama_cpp_engine_bills_the_prompt_it_computed(make_gateway, api, stream):
    options = {"n_ctx": 2048, "n_parallel": 1, "n_batch": 16, "n_threads": 1}
    spec = BackendSpec("local", "local", "", MODEL, options)
    gw = await make_gateway([spec], prices=PRICES)
    await check_prefill_hang_up(gw, engine_count(gw, "local"), api, stream, LOCAL_PROMPT)


async def check_embeddings_hang_up(gw, count: Count, inputs: list[str]) -> None:
    tenant, key = await gw.tenant("embeds")
    c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    before = await count()
    await hang_up(count, c.embeddings.create(model=MODEL, input=inputs))
    (row,) = await until(lambda: rows(gw, tenant["id"]), "the usage row")
    pooled = await count() - before
    assert row.status == 499 and 0 < row.prompt_tokens == pooled
    whole = await c.embeddings.create(model=MODEL, input=inputs)
    assert row.prompt_tokens < whole.usage.prompt_tokens
    used = await gw.state.quota.used(tenant["id"], time.time())
    assert used["daily"] == row.prompt_tokens + whole.usage.prompt_tokens


async def test_gpu_embeddings_cut_short_bill_the_inputs_pooled(make_gateway, tmp_path):
    model = save_tiny_qwen3_embedding(str(tmp_path / "embed"))
    options = {"device": "cpu", "max_num_seqs": 2}  # two inputs a step
    gw = await make_gateway([BackendSpec("embed", "gpu", model, MODEL, options)], prices=PRICES)
    await check_embeddings_hang_up(gw, engine_count(gw, "embed"), INPUTS)


@pytest.mark.slow
async def test_llama_cpp_embeddings_cut_short_bill_the_inputs_pooled(make_gateway):
    options = {"task": "embed", "pooling": "mean", "n_ctx": 64, "n_parallel": 1, "n_threads": 1}
    gw = await make_gateway([BackendSpec("embed", "local", "", MODEL, options)], prices=PRICES)
    # 60 inputs are still several batches of n_ctx on llama.cpp, so the client leaves
    # mid-request; the check then embeds them all once more, which 300 made minutes long
    await check_embeddings_hang_up(gw, engine_count(gw, "embed"), INPUTS[:60])
