"""Prefill and decode on different workers (issue 33, part 2), with real `kvgate worker`
processes on a tiny float32 model: a decode worker pulls a prefill worker's blocks and
continues from them with the output unchanged; every failure of the pull (a dead or
refusing source, another tenant's salt) computes the prompt instead; through a gateway
(`serve --workers 2 --prefill-workers 1`), one request is one usage row with the
same usage as without disaggregation, and a prefill worker killed under load only
slows the first tokens."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import time

import httpx
import pytest
from prometheus_client import generate_latest

from engine_api.kv_records import HEADER_SIZE
from engine_api.records import BackendStats, GenChunk
from gateway.backends import BackendSpec
from gateway.backends.kv_transfer import pack_records, role_of, unpack_records
from gateway.backends.remote_options import RemoteOptions
from gateway.backends.remote_worker import parse_stats
from gateway.cli import build_parser
from gateway.config import Settings
from gateway.config_load import load_settings
from gateway.observe.metrics import Metrics
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.gateway.test_worker import gen_body, http, start_worker

BS = 8
PROMPT_LEN = 201  # 25 full blocks, one token left to compute
OPTIONS = json.dumps({"block_size": BS, "max_model_len": 512})


def prompt(seed: int = 35, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 384) for _ in range(length)]


def test_records_frame_and_unframe():
    records = [b"", b"a" * 5, bytes(range(256))]
    body = pack_records(records)
    assert unpack_records(body) == records
    assert unpack_records(b"") == []
    for cut in (1, 6, len(body) - 1):
        with pytest.raises(ValueError, match="ends inside"):
            unpack_records(body[:cut])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A prefill and a decode worker on the same tiny model."""
    tmp = tmp_path_factory.mktemp("pair")
    model = save_tiny_model("llama", str(tmp))
    args = ["--backend", "gpu", "--model", model, "--served-model-name", "tiny"]
    args += ["--device", "cpu", "--dtype", "float32", "--options", OPTIONS]
    prefill = start_worker(tmp, *args, "--role", "prefill")
    decode = start_worker(tmp, *args, "--role", "decode", "--kv-pull-timeout", "5")
    yield prefill, decode
    prefill.stop()
    decode.stop()


async def run(w, body: dict) -> tuple[list[int], int]:
    """The tokens a worker generated for `body`, and its cached tokens."""
    async with http(w) as c:
        r = await c.post("/kvgate/v1/generate", json=body)
        assert r.status_code == 200, r.text
    chunks = [GenChunk.from_dict(json.loads(line)) for line in r.text.splitlines()]
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage.cached_tokens


async def pulls(w) -> dict:
    async with http(w) as c:
        stats = parse_stats((await c.get("/kvgate/v1/stats")).json(), "w", "worker")
    return stats.extra


@pytest.mark.slow
async def test_a_decode_worker_continues_from_a_prefill_workers_blocks(pair):
    prefill, decode = pair
    # the reference: computed on the decode worker under a salt no one else uses
    reference = await run(decode, gen_body(prompt(), 6, model="tiny", cache_salt="ref"))
    assert reference[1] == 0
    await run(prefill, gen_body(prompt(), 1, model="tiny", cache_salt="tenant-a"))
    body = gen_body(prompt(), 6, model="tiny", cache_salt="tenant-a", kv_source=prefill.url)
    assert await run(decode, body) == reference  # same tokens; taken blocks are not cached
    extra = await pulls(decode)
    assert extra["kv_transfers"] == 1 and extra["kv_transfer_fallbacks"] == 0
    # 25 records: a header and a block (layers x K,V x rows x heads x dims x 4), framed
    assert extra["kv_transfer_bytes"] == 25 * (4 + HEADER_SIZE + 2 * 2 * BS * 2 * 16 * 4)
    assert extra["kv_transfer_seconds"] > 0
    assert extra["kv_transfer_blocks_in"] == 25 and extra["kv_transfer_hits"] == 200
    assert (await pulls(prefill))["kv_transfer_blocks_out"] == 25


@pytest.mark.slow
async def test_another_tenants_request_takes_nothing_from_its_blocks(pair):
    prefill, decode = pair
    reference = await run(decode, gen_body(prompt(7), 4, model="tiny", cache_salt="ref"))
    await run(prefill, gen_body(prompt(7), 1, model="tiny", cache_salt="tenant-a"))
    before = await pulls(decode)
    body = gen_body(prompt(7), 4, model="tiny", cache_salt="tenant-b", kv_source=prefill.url)
    assert await run(decode, body) == reference
    after = await pulls(decode)
    assert after["kv_transfer_fallbacks"] == before["kv_transfer_fallbacks"] + 1
    assert after["kv_transfer_hits"] == before["kv_transfer_hits"]  # nothing taken


@pytest.mark.slow
@pytest.mark.parametrize("source", ["dead", "refusing"])
async def test_a_failed_pull_computes_the_prompt_here(pair, source, tmp_path):
    prefill, decode = pair
    url = "http://127.0.0.1:9" if source == "dead" else decode.url + "/nowhere"
    seed = len(source)  # a prompt of its own
    reference = await run(decode, gen_body(prompt(seed), 4, model="tiny", cache_salt="ref"))
    before = await pulls(decode)
    body = gen_body(prompt(seed), 4, model="tiny", cache_salt=source, kv_source=url)
    assert await run(decode, body) == reference
    after = await pulls(decode)
    assert after["kv_transfer_fallbacks"] == before["kv_transfer_fallbacks"] + 1
    assert after["kv_transfers"] == before["kv_transfers"]


@pytest.mark.slow
async def test_a_worker_that_moves_no_blocks_says_so(tmp_path, pair):
    fake = start_worker(tmp_path, "--backend", "fake")
    try:
        async with http(fake) as c:
            models = (await c.get("/v1/models")).json()["data"]
            r = await c.post("/kvgate/v1/kv/export", json=gen_body([5] * 20, 1))
    finally:
        fake.stop()
    assert models[0]["kvgate"]["role"] == "both"
    assert r.status_code == 400
    assert "does not move KV blocks" in r.json()["error"]["message"]
    prefill, _ = pair
    async with http(prefill) as c:
        assert (await c.get("/v1/models")).json()["data"][0]["kvgate"]["role"] == "prefill"


@pytest.mark.slow
def test_a_role_needs_the_gpu_backend(tmp_path):
    with pytest.raises(RuntimeError, match="--role prefill needs the gpu backend"):
        start_worker(tmp_path, "--backend", "fake", "--role", "prefill")


# -- through a gateway: serve --workers 2 --prefill-workers 1 ---------------------------


@pytest.fixture
async def apart(make_gateway, tmp_path):
    model = save_tiny_model("llama", str(tmp_path))
    options = json.loads(OPTIONS) | {"device": "cpu", "dtype": "float32"}
    spec = BackendSpec("tiny", "gpu", model, "tiny", options)
    return await make_gateway([spec], workers=2, prefill_workers=1, prefill_threshold=64)


async def complete(gw, key: str, seed: int, **fields) -> dict:
    body = {"model": "tiny", "prompt": prompt(seed), "max_tokens": 6, "temperature": 0}
    body |= {"ignore_eos": True} | fields
    r = await gw.post("/v1/completions", key, body)
    assert r.status == 200, await r.text()
    return await r.json()


def jobs(gw, outcome: str) -> float:
    m = gw.state.metrics
    return m.child(m.prefill_jobs, "tiny", outcome)._value.get()


def worker_of(gw, role: str) -> tuple[str, str]:
    (supervisor,) = gw.state.supervisors
    (url,) = supervisor.urls_of(role)
    return url.removesuffix("/v1"), supervisor.token


async def usage_rows(gw, tmp_path, count: int) -> list[tuple]:
    sql = "SELECT tenant_id, prompt_tokens, completion_tokens, cached_tokens FROM usage_records"
    deadline = time.monotonic() + 30
    while True:
        with sqlite3.connect(tmp_path / "gw.db") as conn:
            rows = conn.execute(sql).fetchall()
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_apart_or_not_the_output_and_the_usage_row_are_the_same(apart, tmp_path):
    gw = apart
    assert sorted(role_of(b) for b in gw.state.backends) == ["decode", "prefill"]
    (a, key_a), (b, key_b), (c, key_c) = [await gw.tenant(n) for n in "abc"]
    together = await complete(gw, key_a, 1)  # 201 tokens >= 64: prefilled apart
    assert jobs(gw, "ok") == 1 and jobs(gw, "fallback") == 0
    url, token = worker_of(gw, "decode")
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as h:
        extra = (await h.get(url + "/kvgate/v1/stats")).json()["extra"]
    assert extra["kv_transfers"] == 1 and extra["kv_transfer_hits"] == 200
    gw.state.settings.prefill_threshold = 10**6  # the same prompt, prefilled where it decodes
    alone = await complete(gw, key_b, 1)
    assert jobs(gw, "ok") == 1
    gw.state.settings.prefill_threshold = 64
    # tenant c's prompt, apart again: nothing of a's blocks is taken (its salt differs)
    isolated = await complete(gw, key_c, 1)
    assert jobs(gw, "ok") == 2
    for out in (alone, isolated):
        assert out["choices"][0]["text"] == together["choices"][0]["text"]
        assert out["usage"] == together["usage"]
    assert together["usage"]["prompt_tokens"] == PROMPT_LEN
    assert together["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # one request, one usage row: the prefill jobs have none
    rows = await usage_rows(gw, tmp_path, 3)
    assert sorted(rows) == sorted((t["id"], PROMPT_LEN, 6, 0) for t in (a, b, c))


@pytest.mark.slow
async def test_a_prefill_worker_killed_under_load_only_slows_first_tokens(apart):
    gw = apart
    _, key = await gw.tenant("load")
    gw.state.settings.prefill_threshold = 10**6
    reference = [
        (await complete(gw, key, seed, user="ref"))["choices"][0]["text"] for seed in range(6)
    ]
    gw.state.settings.prefill_threshold = 64
    (supervisor,) = gw.state.supervisors
    prefill = next(w for w in supervisor.workers if w.role == "prefill")
    _, key = await gw.tenant("load-2")  # another salt: nothing cached from the reference
    tasks = [asyncio.ensure_future(complete(gw, key, seed)) for seed in range(6)]
    os.kill(prefill.proc.pid, signal.SIGKILL)
    outs = await asyncio.gather(*tasks)
    assert [o["choices"][0]["text"] for o in outs] == reference
    prefill_replica = next(b for b in gw.state.backends if role_of(b) == "prefill")
    # each request either fell back, or found the prefill replica already down
    assert jobs(gw, "fallback") >= 1 or not prefill_replica.stats().healthy


@pytest.mark.slow
async def test_a_decode_worker_dying_mid_stream_ends_it_with_an_error_event(apart, tmp_path):
    gw = apart
    _, key = await gw.tenant("streams")
    (supervisor,) = gw.state.supervisors
    decode = next(w for w in supervisor.workers if w.role == "decode")
    # 72 tokens: apart; 180 more to stream (the tiny model's context is 256)
    body = {"model": "tiny", "prompt": prompt(3, 72), "max_tokens": 180, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    events: list[dict] = []
    r = await gw.post("/v1/completions", key, body)
    assert r.status == 200, await r.text()
    async for raw in r.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        events.append(json.loads(line.removeprefix("data: ")))
        if len(events) == 1:  # output went out: the decode worker continues from kv_source
            os.kill(decode.proc.pid, signal.SIGKILL)
    assert jobs(gw, "ok") == 1
    assert events[-1]["error"]["message"] and len(events) < 180
    (row,) = await usage_rows(gw, tmp_path, 1)
    delivered = sum(1 for e in events if e.get("choices"))
    assert row[1:] == (72, delivered, 0)


def test_prefill_workers_are_fewer_than_workers():
    args = build_parser().parse_args(
        ["serve", "--workers", "3", "--prefill-workers", "1", "--prefill-threshold", "100"]
    )
    settings = load_settings(
        None,
        {"workers": args.workers}
        | {"prefill_workers": args.prefill_workers, "prefill_threshold": args.prefill_threshold},
        environ={},
    )
    assert (settings.prefill_workers, settings.prefill_threshold) == (1, 100)
    assert load_settings(None, environ={}).prefill_workers == 0  # every worker does both
    for workers, prefill in [(2, 2), (0, 1), (3, -1)]:
        with pytest.raises(ValueError, match="prefill_workers must be fewer than workers"):
            Settings(workers=workers, prefill_workers=prefill)
    with pytest.raises(ValueError, match="role must be one of prefill, decode, both"):
        RemoteOptions.parse(
            BackendSpec("r", "remote", "m", "", {"url": "http://h/v1", "role": "x"})
        )


def test_transfer_counters_reach_metrics():
    extra = {"kv_transfers": 2, "kv_transfer_bytes": 4096, "kv_transfer_seconds": 0.25}
    extra |= {"kv_transfer_fallbacks": 1, "kv_transfer_blocks_in": 50}
    metrics = Metrics(lambda: [BackendStats(name="d", extra=extra)])
    metrics.child(metrics.prefill_jobs, "tiny", "fallback").inc()
    text = generate_latest(metrics.registry).decode()
    for sample in (
        'kvgate:kv_transfers_total{backend="d"} 2.0',
        'kvgate:kv_transfer_bytes_total{backend="d"} 4096.0',
        'kvgate:kv_transfer_seconds_total{backend="d"} 0.25',
        'kvgate:kv_transfer_fallbacks_total{backend="d"} 1.0',
        'kvgate:kv_transfer_blocks_in_total{backend="d"} 50.0',
        'kvgate:prefill_jobs_total{model="tiny",outcome="fallback"} 1.0',
    ):
        assert sample in text, sample
    assert "kv_transfer_blocks_out" not in text  # what a backend does not report
