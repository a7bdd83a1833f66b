"""The shared tier (kv_shared_url): a prefix one engine computed serves another engine
of the same model through Redis, as cached tokens with the output unchanged; a block
keeps its tenant's salt there; a value that is not a whole block of this model, or
that anyone who can write to that database forged or swapped (issue 45), is
recomputed, never used nor counted as cached; and with Redis stopped mid-run the
engines keep serving, counting the failed calls."""

from __future__ import annotations

import json
import random
import shutil
import struct
import uuid
import zlib

import pytest
import redis

from backend_gpu import LLM, SamplingParams
from engine_api.block_hash import hash_blocks
from engine_api.kv_records import HEADER_SIZE, MAGIC, RecordCodec
from tests.redis_server import redis_server
from tests.requests import req

BS = 8
PROMPT_LEN = 201  # 25 full blocks and one token to compute
CACHED = 200
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SECRET = "the secret the gateways share, for tests"
SHARED_REDIS = "redis://127.0.0.1:6379/12"  # the machine's own Redis, a database of ours


@pytest.fixture
def redis_url(tmp_path):
    with redis_server(tmp_path) as (url, proc):
        yield url, proc


def _llm(tiny_model_dir, url: str) -> LLM:
    return _llm_of(tiny_model_dir("llama"), url)


def _llm_of(model: str, url: str, secret: str = SECRET) -> LLM:
    return LLM(model, block_size=BS, kv_shared_url=url, kv_tier_secret=secret)


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
        value = RecordCodec(b"another model!!!", SECRET).encode(key, value[-100:])
    client.set(name, value)
    assert _run(b) == (reference, 5 * BS)
    # refused (by the read-ahead, the lookup or both) and replaced by the block
    # computed again
    assert b.stats().kv_shared_rejected >= 1
    assert _run(_llm(tiny_model_dir, url)) == (reference, CACHED)


class OwnModel:
    """The tiny llama under a config of a test's own: its fingerprint, and so its keys
    in the machine's shared Redis, are no other run's."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.client = redis.Redis.from_url(SHARED_REDIS)
        self.prefixes: set[bytes] = set()

    def llm(self, secret: str = SECRET) -> LLM:
        llm = _llm_of(self.path, SHARED_REDIS, secret)
        self.prefixes.add(llm.engine.kv_tiers.shared.prefix)
        return llm

    def clean(self) -> None:
        for prefix in self.prefixes:
            keys = list(self.client.scan_iter(match=prefix + b"*"))
            if keys:
                self.client.delete(*keys)


@pytest.fixture
def own_model(tiny_model_dir, tmp_path):
    path = tmp_path / "tiny-llama-own"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"kvgate_test": uuid.uuid4().hex}))
    own = OwnModel(str(path))
    yield own
    own.clean()


def _v1_record(fp: bytes, key: bytes, payload: bytes) -> bytes:
    """A record as written before issue 45: a CRC-32 where the MAC is now."""
    head = struct.pack("<4sHH16s32sQI", MAGIC, 1, 0, fp, key, len(payload), zlib.crc32(payload))
    return head + payload


def _spoiled(how: str, value: bytes, next_value: bytes, key: bytes, fp: bytes) -> object:
    """Block 5's value as someone who can write to the database but lacks the secret
    could make it; `next_value`: block 6's."""
    payload = value[HEADER_SIZE:]
    if how == "forged":  # this model and key, chosen bytes, keyed by a guessed secret
        return RecordCodec(fp, "a guess").encode(key, bytes(len(payload)))
    if how == "swapped":  # block 6's valid record, its header naming block 5
        swapped = bytearray(next_value)
        swapped[24:56] = key
        return bytes(swapped)
    if how == "old format":  # valid before issue 45: a CRC, no MAC
        return _v1_record(fp, key, payload)
    if how == "huge":  # read no further than a record
        return value + bytes(64 << 20)
    return None  # "not a string": a list under the name


@pytest.mark.parametrize("how", ["forged", "swapped", "old format", "huge", "not a string"])
def test_a_forged_or_swapped_value_is_recomputed_not_billed_as_cached(own_model, reference, how):
    a, b = own_model.llm(), own_model.llm()
    client = own_model.client
    assert _run(a) == (reference, 0)
    keys = hash_blocks(_prompt()[:CACHED], BS, None)
    prefix = a.engine.kv_tiers.shared.prefix
    name, next_name = (prefix + k.hex().encode() for k in keys[5:7])
    fp = bytes.fromhex(prefix.split(b":")[2].decode())
    spoiled = _spoiled(how, client.get(name), client.get(next_name), keys[5], fp)
    if spoiled is None:
        client.delete(name)
        client.rpush(name, b"not a record")
    else:
        client.set(name, spoiled)
    # the first 5 blocks are taken, block 5 is refused and it and the rest recomputed
    assert _run(b) == (reference, 5 * BS)
    stats = b.stats()
    assert stats.kv_shared_hits == 5 * BS and stats.kv_shared_rejected >= 1
    assert _run(own_model.llm()) == (reference, CACHED)  # replaced by the block recomputed


def test_blocks_another_secret_wrote_are_not_taken(own_model, reference):
    _run(own_model.llm(secret="another gateway's secret, another database"))
    b = own_model.llm()
    assert _run(b) == (reference, 0)
    assert b.stats().kv_shared_hits == 0 and b.stats().kv_shared_rejected >= 1


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
