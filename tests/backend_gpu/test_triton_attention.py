"""The Triton paged attention kernels against the torch path (attention.py, the CPU
path), which is their reference: random keys in blocks scattered over the pool, lengths
on both sides of block boundaries, GQA ratios 1 to 8, sliding windows, an FP8 cache with
its scales, decodes, fresh prompts, chunked prefill and speculative verification in one
batch; then the engine on the kernels against transformers.

Without CUDA they run in Triton's interpreter, which conftest.py turns on before the kernels are
defined. Its tl.dot is wrong on bfloat16 (triton-lang/triton#11584), so float32 and
float16 here; bfloat16 and real sizes are in the CUDA test."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else interpreted (conftest)
pytest.importorskip("triton")

from backend_gpu import LLM  # noqa: E402
from backend_gpu.layers.attention import (  # noqa: E402
    AttentionMetadata,
    DecodeSpan,
    PagedBatch,
    PrefillSpan,
    paged_attention,
)
from backend_gpu.layers.triton_attention import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
)
from backend_gpu.quantization.fp8 import FP8, to_fp8  # noqa: E402
from tests.backend_gpu.test_correctness import check  # noqa: E402

BLOCK = 8
# lengths around block boundaries (1, BLOCK - 1, BLOCK, BLOCK + 1), over several blocks,
# and past one 64-key tile of the kernels
LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 2, 70]
# (cached tokens, new tokens): a fresh prompt over several query tiles, chunks after a
# cached context, a decode, and verifications of 1 to 4 proposed tokens
PREFILL_SHAPES = [(0, 70), (0, 3), (9, 7), (20, 1), (3 * BLOCK, 2), (5, 3), (40, 4), (7, 5)]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SCALE = 0.3


def slots_of(table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache rows of positions [start, end) of the sequence with this block table."""
    positions = torch.arange(start, end)
    return table[positions // block_size].long() * block_size + positions % block_size


@dataclass
class Batch:
    shapes: list[tuple[int, int]]  # (tokens cached before this step, new tokens) each
    q: torch.Tensor  # [T, Hq, D], the new tokens' queries
    k_new: torch.Tensor  # [T, Hkv, D] float32, the new tokens' keys as the cache holds them
    v_new: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], every token's already in
    v_cache: torch.Tensor
    tables: torch.Tensor  # [B, max_blocks] int32
    k_scale: float
    v_scale: float

    def slot_mapping(self) -> torch.Tensor:
        """Cache rows of the new tokens, in query order."""
        bs = self.k_cache.shape[1]
        spans = zip(self.tables, self.shapes, strict=True)
        return torch.cat([slots_of(table, p, p + n, bs) for table, (p, n) in spans])

    def paged(self, device: str = DEVICE) -> PagedBatch:
        news = torch.tensor([n for _, n in self.shapes], dtype=torch.int32)
        lens = torch.tensor([p for p, _ in self.shapes], dtype=torch.int32) + news
        starts = torch.cat([news.new_zeros(1), news.cumsum(0, dtype=torch.int32)])
        tensors = (t.to(device) for t in (self.tables, lens, starts))
        return PagedBatch(*tensors, max_query_len=int(news.max()))


def make_batch(
    shapes, group, dtype=torch.float32, *, fp8=False, block_size=BLOCK, kv_heads=2, dim=16, seed=0
) -> Batch:
    """Random keys and values, written to blocks in random order (a few left unused) of a
    cache in `dtype`, or in FP8 with scales that spread them over E4M3's range."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // block_size) for p, n in shapes]
    num_blocks = sum(need) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(shapes), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([free.pop() for _ in range(n)])
    scales = (0.01, 0.02) if fp8 else (1.0, 1.0)
    caches = [
        torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=FP8 if fp8 else dtype)
        for _ in range(2)
    ]
    news: tuple[list, list] = ([], [])
    for table, (past, new) in zip(tables, shapes, strict=True):
        slots = slots_of(table, 0, past + new, block_size)
        for cache, scale, fresh in zip(caches, scales, news, strict=True):
            rows = cache.flatten(0, 1)
            x = torch.randn(past + new, kv_heads, dim, generator=gen)
            if fp8:  # as bytes: the CPU has no FP8 index_put
                rows.view(torch.uint8)[slots] = to_fp8(x, scale).view(torch.uint8)
            else:
                rows[slots] = x.to(dtype)
            fresh.append(rows[slots[past:]].float() * scale)  # what the cache holds
    num_queries = sum(n for _, n in shapes)
    q = torch.randn(num_queries, group * kv_heads, dim, generator=gen).to(dtype)
    k_new, v_new = (torch.cat(fresh) for fresh in news)
    return Batch(shapes, q, k_new, v_new, *caches, tables, *scales)


def torch_path(batch: Batch, window: int | None) -> torch.Tensor:
    """The torch path in float32 on the batch: decodes one by one, chunks as spans."""
    k_cache, v_cache = (c.flatten(0, 1).clone() for c in (batch.k_cache, batch.v_cache))
    if k_cache.dtype != FP8:
        k_cache, v_cache = k_cache.float(), v_cache.float()
    bs = batch.k_cache.shape[1]
    meta = AttentionMetadata(
        slot_mapping=batch.slot_mapping(),
        block_size=bs,
        k_workspace=torch.empty(k_cache.numel()),
        v_workspace=torch.empty(k_cache.numel()),
    )
    row = 0
    for table, (past, new) in zip(batch.tables.long(), batch.shapes, strict=True):
        blocks = table[: -(-(past + new) // bs)]
        if new == 1:
            meta.decodes.append(DecodeSpan(row, past + 1, blocks))
        else:
            meta.prefills.append(PrefillSpan(row, row + new, past, blocks))
        row += new
    scales = dict(k_scale=batch.k_scale, v_scale=batch.v_scale)
    q = batch.q.float()
    return paged_attention(
        q, batch.k_new, batch.v_new, k_cache, v_cache, meta, SCALE, window, **scales
    )


def decode(batch: Batch, window: int | None, splits: int | None = None) -> torch.Tensor:
    paged = batch.paged()
    return paged_decode_attention(
        batch.q.to(DEVICE),
        batch.k_cache.to(DEVICE),
        batch.v_cache.to(DEVICE),
        paged.block_tables,
        paged.context_lens,
        SCALE,
        window,
        batch.k_scale,
        batch.v_scale,
        num_splits=splits,
    )


def prefill(batch: Batch, window: int | None) -> torch.Tensor:
    paged = batch.paged()
    return paged_prefill_attention(
        batch.q.to(DEVICE),
        batch.k_cache.to(DEVICE),
        batch.v_cache.to(DEVICE),
        paged.block_tables,
        paged.context_lens,
        paged.query_start_loc,
        paged.max_query_len,
        SCALE,
        window,
        batch.k_scale,
        batch.v_scale,
    )


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize(("window", "splits"), [(None, 1), (5, 4)])
def test_decode_matches_torch_path(dtype, group, window, splits):
    batch = make_batch([(n - 1, 1) for n in LENGTHS], group, dtype, seed=group)
    assert_matches(decode(batch, window, splits), torch_path(batch, window), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("window", "splits"), [(None, 2), (BLOCK + 3, 1)])
def test_decode_reads_the_fp8_cache_with_its_scales(dtype, window, splits):
    batch = make_batch([(n - 1, 1) for n in LENGTHS], 2, dtype, fp8=True, dim=32)
    assert batch.k_cache.dtype == FP8
    assert_matches(decode(batch, window, splits), torch_path(batch, window), dtype)


def test_decode_splits_agree_on_long_contexts():
    """Splits of a context merge to what one pass over it computes."""
    batch = make_batch([(200, 1), (130, 1), (3, 1)], 4, kv_heads=1, dim=32, seed=3)
    whole = decode(batch, None, 1)
    for splits in (2, 8):
        torch.testing.assert_close(decode(batch, None, splits), whole, atol=2e-6, rtol=2e-6)
    assert_matches(whole, torch_path(batch, None), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_matches_torch_path(dtype, group, window):
    batch = make_batch(PREFILL_SHAPES, group, dtype, seed=10 + group)
    assert_matches(prefill(batch, window), torch_path(batch, window), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, BLOCK + 3])
def test_prefill_reads_the_fp8_cache_with_its_scales(dtype, window):
    batch = make_batch(PREFILL_SHAPES, 4, dtype, fp8=True, dim=32, seed=20)
    assert_matches(prefill(batch, window), torch_path(batch, window), dtype)


def test_head_dim_that_is_not_a_power_of_two():
    batch = make_batch(PREFILL_SHAPES, 2, dim=24, seed=30)
    assert_matches(prefill(batch, None), torch_path(batch, None), torch.float32)
    decodes = make_batch([(n - 1, 1) for n in LENGTHS], 2, dim=24, seed=31)
    assert_matches(decode(decodes, None), torch_path(decodes, None), torch.float32)


@pytest.mark.parametrize("shapes", [[(n - 1, 1) for n in LENGTHS], PREFILL_SHAPES])
def test_paged_attention_writes_the_new_tokens_then_runs_the_kernels(shapes):
    """With meta.paged set, paged_attention writes the step's keys and values into the
    flat cache (zeroed there first) and the kernels read them back."""
    batch = make_batch(shapes, 2, seed=40)
    k_cache, v_cache = (c.flatten(0, 1).clone().to(DEVICE) for c in (batch.k_cache, batch.v_cache))
    slot_mapping = batch.slot_mapping()
    k_cache[slot_mapping] = v_cache[slot_mapping] = 0.0
    empty = torch.empty(0, device=DEVICE)
    meta = AttentionMetadata(
        slot_mapping.to(DEVICE), BLOCK, empty, empty, paged=batch.paged(DEVICE)
    )
    k, v = batch.k_new.to(DEVICE), batch.v_new.to(DEVICE)
    out = paged_attention(batch.q.to(DEVICE), k, v, k_cache, v_cache, meta, SCALE, 5)
    assert k_cache.flatten(1).abs().sum(1)[slot_mapping].all()
    assert_matches(out, torch_path(batch, 5), torch.float32)


def test_engine_on_the_kernels_matches_transformers(tiny_model_dir):
    """The runner's kernel metadata through the whole engine (chunked prefill, prefix
    caching, decodes; Gemma 3's sliding window and GQA): greedy outputs equal
    transformers'."""
    model_dir = tiny_model_dir("gemma3")
    llm = LLM(model_dir, device=DEVICE, dtype="float32", max_num_batched_tokens=24)
    runner = llm.engine.runner
    assert runner.paged_kernels == (DEVICE == "cuda")
    runner.paged_kernels = True  # on a CPU too: the kernels in the interpreter
    steps = []
    prepare = runner.prepare

    def prepare_and_count(batch, graph_size, prompt_rows):
        prepared = prepare(batch, graph_size, prompt_rows)
        meta = prepared[2]
        assert meta.paged is not None and not meta.prefills and not meta.decode_groups
        steps.append(meta.paged.max_query_len)
        return prepared

    runner.prepare = prepare_and_count
    check(llm, model_dir)
    assert 1 in steps and max(steps) > 1  # both kernels ran


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", [False, True])
def test_real_sizes_on_cuda(dtype, fp8):
    """Model-sized heads, 16-token blocks and long contexts, on the device compiled (the
    interpreter is off whenever CUDA is there)."""
    assert not os.environ.get("TRITON_INTERPRET")
    lengths = [1, 15, 16, 17, 300, 1500, 4097]
    sizes = dict(kv_heads=8, dim=128, block_size=16, fp8=fp8, seed=50)
    for window in (None, 1024):
        decodes = make_batch([(n - 1, 1) for n in lengths], 4, dtype, **sizes)
        assert_matches(decode(decodes, window), torch_path(decodes, window), dtype)
        shapes = [(0, 700), (1000, 300), (4000, 4), (16, 1), (31, 2)]
        chunks = make_batch(shapes, 4, dtype, **sizes)
        assert_matches(prefill(chunks, window), torch_path(chunks, window), dtype)
    gemma = make_batch([(n - 1, 1) for n in lengths], 4, dtype, kv_heads=1, dim=256, seed=51)
    assert_matches(decode(gemma, 512), torch_path(gemma, 512), dtype)
