"""Helpers for engine tests."""

import asyncio

from backend_local import LocalEngine, RequestOutput, SamplingParams


async def collect(
    engine: LocalEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    salt: str | None = None,
    shared_prefix_len: int = 0,
) -> tuple[list[int], str, RequestOutput]:
    """Run one request to the end: (output token ids, text, last output)."""
    ids, text, last = [], "", None
    async for out in engine.generate(request_id, prompt, params, salt, shared_prefix_len):
        assert out.request_id == request_id
        ids += out.token_ids
        text += out.text
        last = out
    assert last is not None and last.finish_reason is not None
    return ids, text, last


async def wait_for(condition) -> None:
    """Poll until `condition()` holds; a deadline only to fail instead of hanging."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.01)
