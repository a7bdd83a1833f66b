"""The Triton MLA kernel (triton_mla.py) against the torch path of mla_attention.py, its
reference: latent rows in blocks scattered over the pool, lengths on both sides of block
and key-tile boundaries, head counts under, at and over a tile (4, 16, 20), decodes split
or whole, fresh prompts, chunked prefill and speculative verification in one batch, an
FP8 cache with its scale; then the DeepSeek-V3 engine on the kernel against transformers.

Without CUDA the kernel runs in Triton's interpreter (conftest.py), in float32 and
float16 (its tl.dot is wrong on bfloat16, triton-lang/triton#11584); model sizes in
bfloat16 are the CUDA test at the end."""

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
)
from backend_gpu.layers.mla_attention import mla_attention  # noqa: E402
from backend_gpu.layers.triton_mla import mla_paged_attention  # noqa: E402
from backend_gpu.quantization.fp8 import FP8, to_fp8  # noqa: E402
from tests.backend_gpu.reference import assert_greedy_matches, hf_greedy  # noqa: E402
from tests.backend_gpu.test_deepseek_v3 import GREEDY, MAX_NEW, prompts  # noqa: E402
from tests.backend_gpu.test_triton_attention import (  # noqa: E402
    BLOCK,
    LENGTHS,
    PREFILL_SHAPES,
    TOLERANCE,
    slots_of,
)

SCALE = 0.15
RANK, ROPE = 32, 16  # the tiny test model's latent and rotary widths
DECODES = [(n - 1, 1) for n in [*LENGTHS, 33, 64, 65]]  # and around the 32-key tile


@dataclass
class LatentBatch:
    shapes: list[tuple[int, int]]  # (tokens cached before this step, new tokens) each
    q: torch.Tensor  # [T, H, R + P] absorbed queries
    new_rows: torch.Tensor  # [T, R + P] float32: the new tokens' rows as the cache holds them
    cache: torch.Tensor  # [num_blocks * block_size, 1, R + P], every token's row in
    tables: torch.Tensor  # [B, max_blocks] int32
    rank: int
    k_scale: float
    block_size: int

    def slot_mapping(self) -> torch.Tensor:
        spans = zip(self.tables, self.shapes, strict=True)
        return torch.cat([slots_of(t, p, p + n, self.block_size) for t, (p, n) in spans])

    def paged(self) -> PagedBatch:
        news = torch.tensor([n for _, n in self.shapes], dtype=torch.int32)
        lens = torch.tensor([p for p, _ in self.shapes], dtype=torch.int32) + news
        starts = torch.cat([news.new_zeros(1), news.cumsum(0, dtype=torch.int32)])
        tensors = (t.to(DEVICE) for t in (self.tables, lens, starts))
        return PagedBatch(*tensors, max_query_len=int(news.max()))


def make_batch(
    shapes, heads, dtype=torch.float32, *, fp8=False, rank=RANK, rope=ROPE, bs=BLOCK, seed=0
) -> LatentBatch:
    """Random latent rows written to blocks in random order (a few left unused) of a
    cache in `dtype`, or in FP8 under one scale for the whole row."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // bs) for p, n in shapes]
    num_blocks = sum(need) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(shapes), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([free.pop() for _ in range(n)])
    k_scale = 0.01 if fp8 else 1.0
    cache = torch.zeros(num_blocks * bs, 1, rank + rope, dtype=FP8 if fp8 else dtype)
    fresh = []
    for table, (past, new) in zip(tables, shapes, strict=True):
        slots = slots_of(table, 0, past + new, bs)
        x = torch.randn(past + new, 1, rank + rope, generator=gen)
        if fp8:  # as bytes: the CPU has no FP8 index_put
            cache.view(torch.uint8)[slots] = to_fp8(x, k_scale).view(torch.uint8)
        else:
            cache[slots] = x.to(dtype)
        fresh.append(cache[slots[past:], 0].float() * k_scale)
    q = torch.randn(sum(n for _, n in shapes), heads, rank + rope, generator=gen).to(dtype)
    return LatentBatch(shapes, q, torch.cat(fresh), cache, tables, rank, k_scale, bs)


def torch_path(batch: LatentBatch) -> torch.Tensor:
    """mla_attention's torch path in float32: decodes one by one, chunks as spans."""
    cache = batch.cache.clone()
    cache = cache if cache.dtype == FP8 else cache.float()
    bs = batch.block_size
    meta = AttentionMetadata(batch.slot_mapping(), bs, torch.empty(cache.numel()), None)
    row = 0
    for table, (past, new) in zip(batch.tables.long(), batch.shapes, strict=True):
        blocks = table[: -(-(past + new) // bs)]
        if new == 1:
            meta.decodes.append(DecodeSpan(row, past + 1, blocks))
        else:
            meta.prefills.append(PrefillSpan(row, row + new, past, blocks))
        row += new
    q = batch.q.float()
    return mla_attention(q, batch.new_rows, cache, meta, SCALE, batch.rank, batch.k_scale)


def kernel(batch: LatentBatch) -> torch.Tensor:
    """mla_attention with meta.paged set: it writes the new rows (zeroed in the cache
    first), then the kernel reads every row through the block tables."""
    cache = batch.cache.clone().to(DEVICE)
    slots = batch.slot_mapping().to(DEVICE)
    cache.view(torch.uint8)[slots] = 0
    meta = AttentionMetadata(slots, batch.block_size, None, None, paged=batch.paged())
    new_rows = batch.new_rows.to(DEVICE, batch.q.dtype)
    q = batch.q.to(DEVICE)
    out = mla_attention(q, new_rows, cache, meta, SCALE, batch.rank, batch.k_scale)
    assert cache.view(torch.uint8)[slots].any(dim=-1).all()  # the new rows were written
    return out


def split_kernel(batch: LatentBatch, splits: int) -> torch.Tensor:
    """The kernel itself over the whole cache, each context in `splits` shares."""
    paged = batch.paged()
    cache = batch.cache.to(DEVICE).view(-1, batch.block_size, batch.cache.shape[-1])
    return mla_paged_attention(
        batch.q.to(DEVICE),
        cache,
        paged.block_tables,
        paged.context_lens,
        paged.query_start_loc,
        paged.max_query_len,
        SCALE,
        batch.rank,
        num_splits=splits,
    )


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [4, 16, 20])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_matches_torch_path(dtype, heads, splits):
    batch = make_batch(DECODES, heads, dtype, seed=heads)
    assert_matches(split_kernel(batch, splits), torch_path(batch), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [4, 20])
def test_prefill_matches_torch_path(dtype, heads):
    """Fresh prompts over several query tiles, chunks after a cached context, a decode
    and verifications in one batch."""
    batch = make_batch(PREFILL_SHAPES, heads, dtype, seed=10 + heads)
    assert_matches(kernel(batch), torch_path(batch), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shapes", [DECODES, PREFILL_SHAPES], ids=["decode", "prefill"])
def test_the_fp8_cache_is_read_with_its_scale(dtype, shapes):
    batch = make_batch(shapes, 4, dtype, fp8=True, seed=20)
    assert batch.cache.dtype == FP8
    assert_matches(kernel(batch), torch_path(batch), dtype)


def test_splits_agree_on_long_contexts():
    """Splits of a context merge to what one pass over it computes; widths not powers of
    two (a latent of 48, a rotary part of 8) are masked."""
    batch = make_batch([(200, 1), (130, 1), (3, 1)], 8, rank=48, rope=8, seed=3)
    whole = split_kernel(batch, 1)
    for splits in (2, 8):
        torch.testing.assert_close(split_kernel(batch, splits), whole, atol=2e-6, rtol=2e-6)
    assert_matches(whole, torch_path(batch), torch.float32)


def test_engine_on_the_kernel_matches_transformers(tiny_model_dir):
    """The runner's kernel metadata through the whole DeepSeek-V3 engine (chunked
    prefill, prefix hits, decodes): greedy outputs equal transformers'."""
    path = tiny_model_dir("deepseek_v3")
    llm = LLM(path, device=DEVICE, dtype="float32", max_num_batched_tokens=24)
    runner = llm.engine.runner
    runner.paged_kernels = True  # on a CPU too: the kernel in the interpreter
    steps = []
    prepare = runner.prepare

    def prepare_and_count(batch, graph_size, prompt_rows):
        prepared = prepare(batch, graph_size, prompt_rows)
        assert prepared[2].paged is not None
        steps.append(prepared[2].paged.max_query_len)
        return prepared

    runner.prepare = prepare_and_count
    refs = hf_greedy(path, prompts(), MAX_NEW)
    for _ in range(2):  # the second time round, from the prefix cache
        for out, (ids, logits) in zip(llm.generate(prompts(), GREEDY), refs, strict=True):
            assert_greedy_matches(out.token_ids, ids, logits)
    assert 1 in steps and max(steps) > 1 and llm.stats().prefix_hits > 0


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", [False, True])
def test_deepseek_sizes_on_cuda(dtype, fp8):
    """DeepSeek-V3's widths (a latent of 512, a rotary key of 64), its 128 heads over 8
    ranks (16) and whole (128), 64-token blocks and long contexts, compiled on the device
    (the interpreter is off whenever CUDA is there)."""
    assert not os.environ.get("TRITON_INTERPRET")
    sizes = dict(rank=512, rope=64, bs=64, fp8=fp8, seed=50)
    lengths = [1, 63, 64, 65, 300, 1500, 4097]
    for heads in (16, 128):
        decodes = make_batch([(n - 1, 1) for n in lengths], heads, dtype, **sizes)
        assert_matches(kernel(decodes), torch_path(decodes), dtype)
        shapes = [(0, 700), (1000, 300), (4000, 4), (16, 1), (31, 2)]
        chunks = make_batch(shapes, heads, dtype, **sizes)
        assert_matches(kernel(chunks), torch_path(chunks), dtype)
