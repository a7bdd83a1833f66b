"""The shared tier (kv_shared_url): a prefix one engine computed serves another engine
of the same model through Redis, as cached tokens with the output unchanged; a block
keeps its tenant's salt there; a value that is not a whole block of this model is
recomputed, never used; and with Redis stopped mid-run the engines keep serving,
counting the failed calls."""

from __future__ import annotations

import random

import pytest
import redis

from backend_gpu import LLM, SamplingParams
from engine_api.block_hash import hash_blocks
from engine_api.kv_records import encode_record
from tests.redis_server import redis_server
from tests.requests import req

BS = 8
PROMPT_LEN = 201  # 25 full blocks and one token to compute
CACHED = 200
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def redis_url(tmp_path):
    with redis_server(tmp_path) as (url, proc):
        yield url, proc


def _llm(tiny_model_dir, url: str) -> LLM:
    return LLM(tiny_model_dir("llama"), block_size=BS, kv_shared_url=url)


def _prompt() -> list[int]:
    rng = random.Random(34)
    return [rng.randrange(4, 384) for _ in range(PROMPT_LEN)]


def _run(llm: LLM, salt: str | None = None) -> tuple[list[int], int]:
    engine = llm.engine
    engine.add_request(req(f"r{engine.stats_.num_steps}", _prompt(), GREEDY, cache_salt=salt))
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, cached = out.token_ids, out.num_cached_tokens
    engine.kv_tiers.flush()
    return list(tokens), cached


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[int]:
    llm = LLM(tiny_model_dir("llama"), block_size=BS)
    engine = llm.engine
    engine.add_request(req("ref", _prompt(), GREEDY))
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.token_ids
    return list(tokens)


def test_one_engines_prefix_serves_another_engine(tiny_model_dir, redis_url, reference):
    url, _ = redis_url
    a, b = _llm(tiny_model_dir, url), _llm(tiny_model_dir, url)
    assert _run(a) == (reference, 0)
    assert a.stats().kv_shared_blocks_written == 25
    assert _run(b) == (reference, CACHED)
    stats = b.stats()
    assert stats.kv_shared_hits == CACHED and stats.kv_shared_errors == 0


def test_a_block_in_the_shared_tier_keeps_its_salt(tiny_model_dir, redis_url, reference):
    url, _ = redis_url
    a, b = _llm(tiny_model_dir, url), _llm(tiny_model_dir, url)
    _run(a, salt="tenant-a")
    assert _run(b, salt="tenant-b") == (reference, 0)
    assert b.stats().kv_shared_hits == 0
    assert _run(b, salt="tenant-a") == (reference, CACHED)
    assert b.stats().kv_shared_hits == CACHED


@pytest.mark.parametrize("how", ["corrupt", "foreign"])
def test_a_bad_value_is_recomputed_never_used(tiny_model_dir, redis_url, reference, how):
    url, _ = redis_url
    a, b = _llm(tiny_model_dir, url), _llm(tiny_model_dir, url)
    _run(a)
    client = redis.Redis.from_url(url)
    key = hash_blocks(_prompt()[:CACHED], BS, None)[5]
    (name,) = client.keys(b"*" + key.hex().encode())
    value = client.get(name)
    if how == "corrupt":
        value = value[:-3] + bytes([value[-3] ^ 0xFF]) + value[-2:]
    else:
        value = encode_record(b"another model!!!", key, value[-100:])
    client.set(name, value)
    assert _run(b) == (reference, 5 * BS)
    # refused (by the read-ahead, the lookup or both) and replaced by the block
    # computed again
    assert b.stats().kv_shared_rejected >= 1
    assert _run(_llm(tiny_model_dir, url)) == (reference, CACHED)


def test_redis_stopped_mid_run_keeps_the_engines_serving(tiny_model_dir, redis_url, reference):
    url, proc = redis_url
    a, b = _llm(tiny_model_dir, url), _llm(tiny_model_dir, url)
    assert _run(a) == (reference, 0)
    proc.kill()
    proc.wait()
    assert _run(b) == (reference, 0)  # nothing to load, computed
    assert _run(b) == (reference, CACHED)  # its own device still caches
    assert b.stats().kv_shared_errors >= 1


def test_kv_shared_url_must_be_a_redis_url(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_shared_url"):
        LLM(tiny_model_dir("llama"), kv_shared_url="http://127.0.0.1:6379")
