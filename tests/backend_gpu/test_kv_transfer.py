"""Blocks between engines (kv_transfer): one engine prefills a prompt, another takes
its blocks and decodes without computing them again, with the output unchanged; the
tokens taken are not the request's cached tokens; records of another model, of
another tenant's salt, or of an engine with another secret are never taken."""

from __future__ import annotations

import random

import pytest

from backend_gpu import LLM, SamplingParams
from tests.requests import req

BS = 8
PROMPT_LEN = 201  # 25 full blocks and one token to compute
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
SECRET = "the secret the gateways share, for tests"


def _prompt() -> list[int]:
    rng = random.Random(35)
    return [rng.randrange(4, 384) for _ in range(PROMPT_LEN)]


def _llm(tiny_model_dir, **kwargs) -> LLM:
    kwargs = {"kv_tier_secret": SECRET} | kwargs
    return LLM(tiny_model_dir("llama"), block_size=BS, kv_transfer=True, **kwargs)


def _run(llm: LLM, params: SamplingParams, salt: str | None = None) -> tuple[list[int], int]:
    engine = llm.engine
    engine.add_request(req(f"r{engine.stats_.num_steps}", _prompt(), params, cache_salt=salt))
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, cached = out.token_ids, out.num_cached_tokens
    return list(tokens), cached


def _move(src: LLM, dst: LLM, salt: str | None = None, dst_salt: str | None = None) -> int:
    keys = src.engine.prompt_keys(req("k", _prompt(), cache_salt=salt))
    records = src.engine.export_kv(keys)
    dst_keys = dst.engine.prompt_keys(req("k", _prompt(), cache_salt=dst_salt))
    return dst.engine.import_kv(dst_keys, records)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[int]:
    return _run(LLM(tiny_model_dir("llama"), block_size=BS), GREEDY)[0]


def test_a_decode_engine_continues_from_a_prefill_engines_blocks(tiny_model_dir, reference):
    prefill, decode = _llm(tiny_model_dir), _llm(tiny_model_dir)
    _run(prefill, PREFILL)
    assert _move(prefill, decode) == 25
    before = decode.stats().num_batched_tokens_total
    assert _run(decode, GREEDY) == (reference, 0)  # taken, not cached
    stats = decode.stats()
    # one prompt token and the decodes computed, not the 200 taken
    assert stats.num_batched_tokens_total - before == 1 + 3
    assert stats.kv_transfer_hits == 200 and stats.kv_transfer_blocks_in == 25
    assert prefill.stats().kv_transfer_blocks_out == 25


def test_records_of_another_model_are_refused(tiny_model_dir, reference):
    prefill = _llm(tiny_model_dir, dtype="bfloat16")
    decode = _llm(tiny_model_dir)
    _run(prefill, PREFILL)
    assert _move(prefill, decode) == 0
    assert decode.stats().kv_transfer_rejected == 1
    assert _run(decode, GREEDY) == (reference, 0)
    assert decode.stats().kv_transfer_hits == 0


def test_records_of_an_engine_with_another_secret_are_refused(tiny_model_dir, reference):
    prefill = _llm(tiny_model_dir, kv_tier_secret="another gateway's secret")
    decode = _llm(tiny_model_dir)
    _run(prefill, PREFILL)
    assert _move(prefill, decode) == 0
    assert decode.stats().kv_transfer_rejected == 1
    assert _run(decode, GREEDY) == (reference, 0)


def test_another_salts_request_finds_nothing_to_take(tiny_model_dir, reference):
    prefill, decode = _llm(tiny_model_dir), _llm(tiny_model_dir)
    _run(prefill, PREFILL, salt="tenant-a")
    assert _move(prefill, decode, salt="tenant-b", dst_salt="tenant-b") == 0
    # records exported under tenant-a's keys are refused under tenant-b's
    assert _move(prefill, decode, salt="tenant-a", dst_salt="tenant-b") == 0
    assert decode.stats().kv_transfer_rejected == 1
    assert _run(decode, GREEDY, salt="tenant-b") == (reference, 0)


def test_an_engine_without_kv_transfer_refuses_to_export(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), block_size=BS)
    with pytest.raises(ValueError, match="kv_transfer"):
        llm.engine.export_kv([])
