"""Block manager and scheduler bookkeeping, driven without a model: random admissions,
steps, finishes, aborts and preemptions never leak a block or share one across salts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from backend_gpu.block_manager import Block, BlockManager, FreeBlockQueue
from backend_gpu.config import EngineConfig
from backend_gpu.scheduler import Scheduler
from backend_gpu.sequence import Sequence
from engine_api.block_hash import hash_blocks
from engine_api.sampling import SamplingParams
from tests.backend_gpu.model_free_steps import advance
from tests.requests import req

BS = 4


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table)
        for block_id in seq.block_table:
            refs[block_id] += 1
    assert refs == [b.ref_count for b in bm.blocks]
    assert bm.num_free_blocks == sum(1 for r in refs if r == 0)
    for block_hash, block in bm.cached.items():
        assert block.hash == block_hash
    # blocks are shared only by sequences with the same salt
    owner_salt: dict[int, str | None] = {}
    for seq in live:
        for block_id in seq.block_table:
            if block_id in owner_salt:
                assert owner_salt[block_id] == seq.cache_salt
            owner_salt[block_id] = seq.cache_salt


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "step", "step", "step", "finish", "abort"]),
        st.integers(0, 3),  # prompt family: shared prefixes within a family
        st.sampled_from([None, "a", "b"]),  # salt
        st.integers(1, 30),  # length
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 24), prefix=st.booleans(), budget=st.integers(1, 40))
def test_random_traffic_leaks_no_block_and_shares_only_within_a_salt(
    ops, num_blocks, prefix, budget
):
    config = EngineConfig(model="", block_size=BS, max_num_seqs=4, max_num_batched_tokens=budget)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
    sched = Scheduler(config, bm)
    live: list[Sequence] = []
    next_id = 0
    for op, family, salt, length in ops:
        if op == "add":
            prompt = [family * 100 + i for i in range(length)]
            max_tokens = 1 + length % 5
            if bm.blocks_needed(length + max_tokens) > num_blocks:
                continue  # the engine refuses these at admission
            seq = Sequence(req(str(next_id), prompt, SamplingParams(max_tokens=max_tokens), salt))
            next_id += 1
            sched.add(seq)
            live.append(seq)
        elif op == "step":
            batch = sched.schedule()
            assert batch.num_tokens <= budget
            advance(sched, bm, batch, live)
        elif live:
            seq = live[(family + length) % len(live)]
            sched.finish(seq, op)
            live.remove(seq)
        check_invariants(bm, live)
    # everything left runs to completion without a hang
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert batch.seqs, "scheduler stalled"
        advance(sched, bm, batch, live)
        check_invariants(bm, live)
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == num_blocks


def test_prefix_hits_need_same_salt_and_leave_a_token_to_compute():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    first = Sequence(req("1", list(range(12)), SamplingParams(), cache_salt="t1"))
    bm.allocate(first, [])
    bm.append_slots(first, 12)
    first.num_computed_tokens = 12
    bm.cache_full_blocks(first)
    same = Sequence(req("2", list(range(12)), SamplingParams(), cache_salt="t1"))
    other = Sequence(req("3", list(range(12)), SamplingParams(), cache_salt="t2"))
    longer = Sequence(req("4", list(range(13)), SamplingParams(), cache_salt="t1"))
    assert len(bm.find_cached_blocks(same)) == 2  # 12 tokens: the last block is recomputed
    assert bm.find_cached_blocks(other) == []
    assert len(bm.find_cached_blocks(longer)) == 3
    assert hash_blocks(list(range(8)), BS, "t1") != hash_blocks(list(range(8)), BS, "t2")


def test_freed_blocks_stay_cached_until_evicted_least_recent_first():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    seq = Sequence(req("1", list(range(8)) + [99], SamplingParams()))
    bm.allocate(seq, [])
    bm.append_slots(seq, 9)
    seq.num_computed_tokens = 9
    bm.cache_full_blocks(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 4
    again = Sequence(req("2", list(range(8)) + [98], SamplingParams()))
    assert len(bm.find_cached_blocks(again)) == 2
    # three new blocks: the never-used block goes first, then the freed tail
    # (block 2, 1) before the prefix head (block 0)
    taker = Sequence(req("3", [50] * 12, SamplingParams()))
    bm.allocate(taker, [])
    bm.append_slots(taker, 12)
    assert [bm.blocks[b].hash for b in taker.block_table].count(None) == 3
    assert len(bm.find_cached_blocks(again)) == 1


def test_free_queue_is_lru_with_o1_removal():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [queue.popleft().block_id for _ in range(2)] == [0, 1]
    queue.append(blocks[2])
    assert [queue.popleft().block_id for _ in range(3)] == [3, 4, 2]
    assert len(queue) == 0
