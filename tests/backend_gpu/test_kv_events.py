"""KV events and published-prefix hashing: replaying the events always gives the
cache's contents, and two salts share exactly the blocks of the published prefix."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_gpu import LLM, AsyncLLM, SamplingParams
from backend_gpu.block_manager import BlockManager
from backend_gpu.config import EngineConfig
from backend_gpu.scheduler import Scheduler
from backend_gpu.sequence import Sequence
from engine_api.block_hash import block_salt, hash_blocks
from tests.backend_gpu.model_free_steps import advance
from tests.requests import req

BS = 4


def replay(mirror: dict[bytes, str | None], bm: BlockManager) -> None:
    for event in bm.take_events():
        if event.kind == "stored":
            assert event.block_hash not in mirror
            assert len(event.token_ids) == BS
            mirror[event.block_hash] = event.cache_salt
        else:
            assert event.kind == "removed"
            del mirror[event.block_hash]


def prefill(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate(seq, bm.find_cached_blocks(seq))
    bm.append_slots(seq, len(seq) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "step", "step", "step", "finish"]),
        st.integers(0, 3),  # prompt family: shared prefixes within a family
        st.sampled_from(["a", "b", "c"]),  # tenant salt
        st.integers(1, 30),  # length
        st.integers(0, 12),  # shared (published) prefix length
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 24), budget=st.integers(1, 40))
def test_events_replay_to_the_cache_and_blocks_cross_salts_only_when_published(
    ops, num_blocks, budget
):
    config = EngineConfig(model="", block_size=BS, max_num_seqs=4, max_num_batched_tokens=budget)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=True, enable_kv_events=True)
    sched = Scheduler(config, bm)
    mirror: dict[bytes, str | None] = {}
    live: list[Sequence] = []

    def check() -> None:
        replay(mirror, bm)
        assert mirror.keys() == bm.cached.keys()
        # a block held by several sequences was hashed with one salt by all of them:
        # across tenants that is only the (salt-free) published prefix
        salt_of: dict[int, str | None] = {}
        for seq in live:
            for i, block_id in enumerate(seq.block_table[: len(seq.block_hashes)]):
                salt = block_salt(i, BS, seq.cache_salt, seq.shared_prefix_len)
                assert salt_of.setdefault(block_id, salt) == salt

    next_id = 0
    for op, family, salt, length, shared in ops:
        if op == "add":
            prompt = [family * 100 + i for i in range(length)]
            max_tokens = 1 + length % 5
            if bm.blocks_needed(length + max_tokens) > num_blocks:
                continue  # the engine refuses these at admission
            params = SamplingParams(max_tokens=max_tokens)
            seq = Sequence(req(str(next_id), prompt, params, salt, 0, min(shared, length)))
            next_id += 1
            sched.add(seq)
            live.append(seq)
        elif op == "step":
            advance(sched, bm, sched.schedule(), live)
        elif live:
            seq = live[(family + length) % len(live)]
            sched.finish(seq, "abort")
            live.remove(seq)
        check()
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        advance(sched, bm, sched.schedule(), live)
        check()
    assert bm.num_free_blocks == num_blocks


def test_two_salts_share_the_published_blocks_and_nothing_after():
    bm = BlockManager(16, BS, enable_prefix_caching=True, enable_kv_events=True)
    prompt = list(range(13))
    prefill(bm, Sequence(req("a", prompt, SamplingParams(), "tenant-a", shared_prefix_len=8)))
    stored = bm.take_events()
    assert [e.cache_salt for e in stored] == [None, None, "tenant-a"]
    assert [e.parent_hash for e in stored] == [None, stored[0].block_hash, stored[1].block_hash]
    assert [e.token_ids for e in stored] == [prompt[0:4], prompt[4:8], prompt[8:12]]

    other = Sequence(req("b", prompt, SamplingParams(), "tenant-b", shared_prefix_len=8))
    assert [b.hash for b in bm.find_cached_blocks(other)] == [e.block_hash for e in stored[:2]]
    # without the published prefix, tenant b gets nothing; tenant a gets all three
    assert bm.find_cached_blocks(Sequence(req("c", prompt, SamplingParams(), "tenant-b"))) == []
    same = Sequence(req("d", prompt, SamplingParams(), "tenant-a", shared_prefix_len=8))
    assert len(bm.find_cached_blocks(same)) == 3
    # a published prefix that ends mid-block shares only its whole blocks
    part = hash_blocks(prompt, BS, "tenant-b", shared_prefix_len=6)
    assert part[0] == stored[0].block_hash and part[1] != stored[1].block_hash


def test_eviction_is_reported_and_events_are_off_by_default():
    bm = BlockManager(3, BS, enable_prefix_caching=True, enable_kv_events=True)
    first = Sequence(req("1", list(range(9)), SamplingParams(), "s"))
    prefill(bm, first)
    stored = bm.take_events()
    assert [e.kind for e in stored] == ["stored", "stored"]
    bm.free(first)
    prefill(bm, Sequence(req("2", [50] * 12, SamplingParams(), "s")))  # needs every block
    kinds = [(e.kind, e.block_hash) for e in bm.take_events()]
    assert ("removed", stored[0].block_hash) in kinds
    assert ("removed", stored[1].block_hash) in kinds
    assert bm.take_events() == []

    quiet = BlockManager(3, BS, enable_prefix_caching=True)
    prefill(quiet, Sequence(req("3", list(range(9)), SamplingParams())))
    assert quiet.events is None and quiet.take_events() == []


def test_engine_reports_the_prompt_blocks_and_rejects_a_bad_shared_prefix(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), block_size=BS, enable_kv_events=True)
    prompt = list(range(5, 19))  # 14 tokens: three full blocks
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    events = llm.engine.take_kv_events()
    assert [e.block_hash for e in events] == hash_blocks(prompt, BS, None)
    assert llm.engine.take_kv_events() == []
    with pytest.raises(ValueError, match="shared_prefix_len"):
        llm.engine.add_request(req("x", prompt, SamplingParams(), "s", 0, len(prompt) + 1))
    assert not llm.engine.has_unfinished_requests()


async def test_async_engine_hands_events_to_the_loop(tiny_model_dir):
    engine = AsyncLLM(tiny_model_dir("llama"), block_size=BS, enable_kv_events=True)
    try:
        prompt = list(range(5, 18))
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        outs = [o async for o in engine.generate(req("r1", prompt, params, "salt-a", 0, 8))]
        assert outs[-1].finished
        events = engine.take_kv_events()
        for _ in range(50):  # the engine thread publishes them after the step
            if len(events) >= 3:
                break
            await asyncio.sleep(0.02)
            events += engine.take_kv_events()
        assert [e.block_hash for e in events] == hash_blocks(prompt, BS, "salt-a", 8)
        assert [e.cache_salt for e in events] == [None, None, "salt-a"]
    finally:
        await engine.shutdown()
