"""Helpers for engine tests."""

import asyncio

from backend_local import LocalEngine, RequestOutput, SamplingParams
from backend_local.sampling import TokenLogprob
from tests.requests import req


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
    async for out in engine.generate(
        req(request_id, prompt, params, salt, shared_prefix_len=shared_prefix_len)
    ):
        assert out.request_id == request_id
        ids += out.token_ids
        text += out.text
        last = out
    assert last is not None and last.finish_reason is not None
    return ids, text, last


async def collect_logprobs(
    engine: LocalEngine, request_id: str, prompt: list[int], params: SamplingParams, salt: str
) -> tuple[list[int], list[TokenLogprob], RequestOutput]:
    """Run one request with logprobs on: (output token ids, their logprobs, last output)."""
    ids, logprobs, last = [], [], None
    async for out in engine.generate(req(request_id, prompt, params, salt)):
        ids += out.token_ids
        logprobs += out.logprobs
        last = out
    assert last is not None and last.finish_reason is not None
    return ids, logprobs, last


# llama.cpp's CPU kernels are not batch-invariant: with one KV stream per sequence, a
# sequence decoded beside others sees its logprobs move by up to about 0.2 nats (as in
# llama-server). Two greedy runs of one prompt must agree until a near-tie of this size.
NEAR_TIE_NATS = 0.5


def assert_same_up_to_near_tie(
    ids_a: list[int],
    logprobs_a: list[TokenLogprob],
    ids_b: list[int],
    logprobs_b: list[TokenLogprob],
) -> None:
    """Greedy outputs agree token for token, with logprobs within NEAR_TIE_NATS, up to the
    first token where each run's choice is the other's runner-up within NEAR_TIE_NATS."""
    for a, b, lp_a, lp_b in zip(ids_a, ids_b, logprobs_a, logprobs_b, strict=False):
        if a == b:
            assert abs(lp_a.logprob - lp_b.logprob) <= NEAR_TIE_NATS, (a, lp_a, lp_b)
            continue
        top_a, top_b = dict(lp_a.top), dict(lp_b.top)
        assert b in top_a and top_a[a] - top_a[b] <= NEAR_TIE_NATS, (lp_a, lp_b)
        assert a in top_b and top_b[b] - top_b[a] <= NEAR_TIE_NATS, (lp_a, lp_b)
        return  # past a near-tie the two continuations differ


async def wait_for(condition) -> None:
    """Poll until `condition()` holds; a deadline only to fail instead of hanging."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.01)
