"""Prefill and decode on different workers (issue 33, part 2), with real `kvgate worker`
processes on a tiny float32 model: a decode worker pulls a prefill worker's blocks and
continues from them with the output unchanged; every failure of the pull (a dead or
refusing source, another tenant's salt) computes the prompt instead; through a gateway
(`serve --workers 2 --prefill-workers 1`), one request is one usage row with the
same usage as without disaggregation, and a prefill worker killed under load only
slows the first tokens."""

from __future__ import annotations

import json
import random

import pytest

from engine_api.kv_records import HEADER_SIZE
from engine_api.records import GenChunk
from gateway.backends.kv_transfer import pack_records, unpack_records
from gateway.backends.remote_worker import parse_stats
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.gateway.test_worker import gen_body, http, start_worker

BS = 8
PROMPT_LEN = 201  # 25 full blocks, one token left to compute
OPTIONS = json.dumps({"block_size": BS, "max_model_len": 512})
pytestmark = pytest.mark.slow


def prompt(seed: int = 35) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 384) for _ in range(PROMPT_LEN)]


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


def test_a_role_needs_the_gpu_backend(tmp_path):
    with pytest.raises(RuntimeError, match="--role prefill needs the gpu backend"):
        start_worker(tmp_path, "--backend", "fake", "--role", "prefill")
