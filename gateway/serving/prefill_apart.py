"""Prefill and decode on different workers: the gateway pairs a long prompt's decode
replica with a prefill replica.

A long prompt's prefill, run in the same steps as other requests' decodes, stalls every
one of them (their time per output token jumps each time one arrives). With prefill
workers (`serve --prefill-workers`, or remote entries with `options.role`), the router
picks the decode replica as for any request (by load and prefix) and this module picks
a prefill replica by its queue (the least running and waiting), sends it the same
GenRequest with max_tokens = 1 (an internal job: not billed, not metered, not streamed,
no usage row), then lets the request go to the decode replica with `kv_source` naming
the prefill worker, which the decode worker pulls the blocks from
(gateway/worker/kv_pull.py).

Only a prompt the decode replica would mostly compute goes this way: one at least
`prefill_threshold` tokens long, counting the leading blocks the catalog says the decode
replica holds as not to compute. A prefill job that fails or takes longer than
`prefill_timeout_s` only means the decode replica computes the prompt (a slower first
token); it is counted (kvgate:prefill_jobs, outcome fallback). Billing is unchanged: one
request, one usage row, and its cached tokens are the larger of the prefill job's and
the decode side's (the blocks the decode worker took are not cached tokens there). A
request cut while its prefill job runs pays for what the prefill replica computed of it
(the job's Progress), as one cut on a single replica does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from engine_api.records import GenRequest, Progress
from engine_api.sampling import SamplingParams
from gateway.backends import Backend, BackendError, BadRequestError
from gateway.backends.kv_transfer import DECODE, role_of
from gateway.routing.router import Candidate
from gateway.state import GatewayState

log = logging.getLogger("kvgate")


async def prefill_apart(
    gw: GatewayState,
    decode: Backend,
    requests: list[GenRequest],
    n: int,
    block_hashes: list[str],
    progress: dict[int, Progress],
) -> tuple[list[GenRequest], dict[int, int]]:
    """`requests` (one per choice, prompt-major, `n` a prompt) with `kv_source` set on
    the choices of each prompt a prefill replica computed, and each such prompt's cached
    tokens on that replica. Unchanged, and {}, where nothing goes apart. `progress` gets,
    per prompt sent apart, how much of it the prefill replica computed: what a request
    cut meanwhile pays (none for a prompt whose job failed: the decode replica computes
    it)."""
    if role_of(decode) != DECODE:  # only a decode worker pulls blocks
        return requests, {}
    prompts = requests[::n]
    long = [i for i, r in enumerate(prompts) if _goes_apart(gw, decode, r, block_hashes, i)]
    replicas = gw.router.prefill_replicas(prompts[0].model) if long else []
    if not replicas:
        return requests, {}
    progress.update({i: Progress() for i in long})
    results = await asyncio.gather(*(_prefill(gw, replicas, prompts[i], progress[i]) for i in long))
    cached: dict[int, int] = {}
    sources: dict[int, str] = {}
    for i, result in zip(long, results, strict=True):
        if result is not None:
            sources[i], cached[i] = result
        else:
            del progress[i]
    out = [
        dataclasses.replace(r, kv_source=sources[c // n]) if c // n in sources else r
        for c, r in enumerate(requests)
    ]
    return out, cached


def _goes_apart(
    gw: GatewayState, decode: Backend, req: GenRequest, block_hashes: list[str], index: int
) -> bool:
    """Whether the decode replica would compute at least the threshold of `req`'s prompt
    (the first prompt's blocks it holds are not computed there)."""
    if req.sampling.prompt_logprobs is not None:  # every prompt position is computed anyway
        return False
    tokens = len(req.prompt_token_ids)
    if index == 0 and block_hashes:
        held = gw.catalog.match_tiers(decode.name, block_hashes)[0]
        tokens -= tokens * held // len(block_hashes)
    return tokens >= gw.settings.prefill_threshold


def _least_queued(gw: GatewayState, replicas: list[Candidate]) -> Backend:
    def queue(c: Candidate) -> int:
        s = c.stats
        return max(s.running + s.waiting, gw.router.in_flight.get(s.name, 0))

    return min(replicas, key=queue).backend


async def _prefill(
    gw: GatewayState, replicas: list[Candidate], req: GenRequest, progress: Progress
) -> tuple[str, int] | None:
    """The prefill replica's base URL and its cached tokens of the prompt, once it has
    computed the prompt's blocks; None (a fallback, counted) if it could not."""
    replica = _least_queued(gw, replicas)
    job = dataclasses.replace(
        req, request_id=req.request_id + "-prefill", sampling=SamplingParams(max_tokens=1)
    )
    m = gw.metrics
    gw.router.claim(replica)
    try:
        async with asyncio.timeout(gw.settings.prefill_timeout_s):
            cached = await _run(replica, job, progress)
    except (BackendError, BadRequestError, TimeoutError) as e:
        log.warning(
            "request %s: prefill on %s failed (%s); the decode replica computes its prompt",
            *(req.request_id, replica.name, str(e) or type(e).__name__),
        )
        m.child(m.prefill_jobs, req.model, "fallback").inc()
        return None
    finally:
        gw.router.release(replica)
    m.child(m.prefill_jobs, req.model, "ok").inc()
    return replica.kv_url, cached  # type: ignore[attr-defined]  # a prefill role: remote


async def _run(replica: Backend, job: GenRequest, progress: Progress) -> int:
    """The job's cached tokens as the replica reports them, within the prompt (a claim)."""
    cached = 0
    stream = replica.generate(job, progress)
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for chunk in stream:
            if chunk.usage is not None:
                cached = chunk.usage.cached_tokens
    if type(cached) is not int:
        return 0
    return min(max(cached, 0), len(job.prompt_token_ids))
