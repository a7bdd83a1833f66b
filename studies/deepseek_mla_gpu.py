"""The GPU half of studies/deepseek_mla.py (`--device cuda`, a gpu_check.sh step): one
layer's decode attention of DeepSeek-V3 on the paged cache, the MLA kernel over the
latent rows against the dense kernel over every head's keys and values.

Shapes: the latent 512 and rotary key 64 (a row of 576 values, bfloat16), 16 query heads
(a rank of TP 8, as DeepSeek-V3 is served) and 128 (one device holding them all), batches
of 1 to 64 sequences of 4096 to 32768 tokens in 64-token blocks scattered over the pool.
The dense kernel reads 16 heads' keys of 192 and values of 128 (padded to 192: its K and
V share a width) where they fit the GPU. Each is timed by CUDA events over repeated
launches after a warm-up; the MLA kernel's bytes read (the latent rows of every context,
once per 16-row tile of heads) over its time is its bandwidth, against the GPU's peak
(H100 3.35 TB/s, H200 4.8 TB/s).
"""

from __future__ import annotations

import torch

from backend_gpu.layers.triton_attention import paged_decode_attention
from backend_gpu.layers.triton_mla import ROWS, mla_paged_attention

RANK, ROPE, NOPE, V = 512, 64, 128, 128
BLOCK = 64
CASES = [  # (heads, batch, context)
    (16, 1, 4096),
    (16, 1, 32768),
    (16, 16, 4096),
    (16, 64, 4096),
    (16, 16, 32768),
    (128, 1, 32768),
    (128, 16, 4096),
    (128, 64, 4096),
]
DENSE_BYTES_LIMIT = 24 << 30  # the dense caches it builds (K and V, 16 heads of 192)


def _time(fn, repeats: int = 20) -> float:
    """Mean seconds of fn() on the GPU, after two warm-up calls (compilation)."""
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def _tables(batch: int, context: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block tables of `batch` sequences of `context` tokens over a shuffled pool."""
    per_seq = -(-context // BLOCK)
    blocks = torch.randperm(batch * per_seq, device=device).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return blocks.view(batch, per_seq), lens, batch * per_seq


def _mla_seconds(heads: int, batch: int, context: int, tables, lens, num_blocks) -> float:
    device = tables.device
    cache = torch.randn(num_blocks, BLOCK, RANK + ROPE, dtype=torch.bfloat16, device=device)
    q = torch.randn(batch, heads, RANK + ROPE, dtype=torch.bfloat16, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return _time(lambda: mla_paged_attention(q, cache, tables, lens, starts, 1, 0.1, RANK))


def _dense_seconds(heads: int, batch: int, tables, lens, num_blocks) -> float:
    shape = (num_blocks, BLOCK, heads, NOPE + ROPE)
    k = torch.randn(shape, dtype=torch.bfloat16, device=tables.device)
    v = torch.randn(shape, dtype=torch.bfloat16, device=tables.device)
    q = torch.randn(batch, heads, NOPE + ROPE, dtype=torch.bfloat16, device=tables.device)
    return _time(lambda: paged_decode_attention(q, k, v, tables, lens, 0.1))


def one_case(heads: int, batch: int, context: int) -> dict:
    tables, lens, num_blocks = _tables(batch, context, torch.device("cuda"))
    seconds = _mla_seconds(heads, batch, context, tables, lens, num_blocks)
    torch.cuda.empty_cache()
    head_tiles = -(-heads // ROWS)
    latent_bytes = batch * context * (RANK + ROPE) * 2 * head_tiles
    row = {
        "heads": heads,
        "batch": batch,
        "context": context,
        "mla_us": seconds * 1e6,
        "mla_gb_per_s": latent_bytes / seconds / 1e9,
    }
    dense_bytes = 2 * num_blocks * BLOCK * heads * (NOPE + ROPE) * 2
    if heads == 16 and dense_bytes <= DENSE_BYTES_LIMIT:
        dense = _dense_seconds(heads, batch, tables, lens, num_blocks)
        row |= {"dense_us": dense * 1e6, "mla_speedup": dense / seconds}
        torch.cuda.empty_cache()
    return row


def gpu_study() -> list[dict]:
    rows = []
    for case in CASES:
        row = one_case(*case)
        print(row, flush=True)
        rows.append(row)
    return rows
