"""Multi-head latent attention in Triton, the CUDA path of layers/mla_attention.py
(whose torch path is its reference): absorbed queries against the latent cache read
through the block tables, no gather and nothing decompressed.

The cache has one row per token, [latent (R) | rotary key (P)], shared by every query
head (DeepSeek-V3: R 512, P 64). A program takes a tile of rows, each a (new token,
query head) pair: the heads of one token share each key tile loaded, as GQA's groups do
in triton_attention.py, but here all heads are one group. Scores are two dots, the
absorbed query's latent part against the latents and its rotary part against the rotary
keys (so neither operand is padded to R + P's next power of two, 1024 for 576); the
values are the latents themselves, so the same tile of keys serves the output dot.

One kernel serves decode, prefill, chunked prefill and speculative verification: rows
of a token attend causally to its context (its own row already written to the cache).
Each context is split over programs (flash decoding) so a short batch still fills the
GPU, and the splits are merged by their log-sum-exp with triton_attention's merge
kernel. A program's rows are BLOCK_H heads of BLOCK_Q tokens: 16 rows, as SGLang's MLA
decode kernel takes, whose accumulator [16, 512] in float32 is what a program's
registers hold. Prefill thus reads every key tile once per 16 (token, head) rows; a
decompressed prefill (vLLM's, FlashAttention over up-projected keys) would read less
for long prompts, and is not built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_gpu.layers.triton_attention import LOG2E, MIN_DOT, _decode_merge_kernel, _widen
from backend_gpu.layers.triton_launch import dot_precision, splits_to_fill

ROWS = 16  # (token, head) rows of a program
KEY_TILE = 32  # keys per inner step: a [32, 512] latent tile is 32 KiB in 16 bits


@triton.jit
def _mla_split_kernel(
    q_ptr,  # [T, H, R + P]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, R + P]
    tables_ptr,
    lens_ptr,
    q_starts_ptr,
    out_ptr,  # [T, H, R]: the output, when NUM_SPLITS is 1
    part_out,  # [T, H, NUM_SPLITS, BLOCK_R] float32: the splits' outputs, to merge
    part_lse,  # [T, H, NUM_SPLITS] float32
    score_scale,  # softmax scale (k_scale folded in) x log2(e)
    stride_tb,
    HEADS: tl.constexpr,
    RANK: tl.constexpr,  # R
    ROPE: tl.constexpr,  # P
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (sequence, query tile x head tile, split): BLOCK_Q tokens x BLOCK_H heads
    over one share of the keys any of them may see; writes the normalized output (one
    split), or the split's and its log-sum-exp (base 2) for the merge."""
    seq, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    head_tiles = (HEADS + BLOCK_H - 1) // BLOCK_H
    q_tile, h_tile = tile // head_tiles, tile % head_tiles
    q_start = tl.load(q_starts_ptr + seq)
    q_len = tl.load(q_starts_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(lens_ptr + seq)
    first_pos = ctx - q_len + q_tile * BLOCK_Q  # position of the tile's first token
    keys = tl.minimum(first_pos + BLOCK_Q, ctx)
    per_split = tl.cdiv(tl.cdiv(keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    key_lo = split * per_split
    key_hi = tl.minimum(key_lo + per_split, keys)

    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    token = q_tile * BLOCK_Q + offs_m // BLOCK_H
    head = h_tile * BLOCK_H + offs_m % BLOCK_H
    row_ok = (token < q_len) & (head < HEADS)
    q_pos = ctx - q_len + token
    offs_r, offs_p = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_P)
    r_ok, p_ok = offs_r < RANK, offs_p < ROPE
    width = RANK + ROPE
    q_rows = ((q_start + token) * HEADS + head) * width
    q_lat = tl.load(
        q_ptr + q_rows[:, None] + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0
    )
    q_pe = tl.load(
        q_ptr + q_rows[:, None] + RANK + offs_p[None, :],
        mask=row_ok[:, None] & p_ok[None, :],
        other=0.0,
    )
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_R], tl.float32)
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    table = tables_ptr + seq * stride_tb
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(key_lo, key_hi, BLOCK_N):
        key_pos = start + offs_n
        key_ok = key_pos < key_hi
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        rows = (block * BLOCK_SIZE + key_pos % BLOCK_SIZE) * width
        # masked lanes read as 0: garbage there could be NaN, and 0 * NaN spoils the dots
        latent = tl.load(
            cache_ptr + rows[:, None] + offs_r[None, :],
            mask=key_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        latent = _widen(latent, q_lat.dtype)
        k_pe = tl.load(
            cache_ptr + rows[None, :] + RANK + offs_p[:, None],
            mask=key_ok[None, :] & p_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
        s += tl.dot(q_pe, _widen(k_pe, q_pe.dtype), input_precision=PRECISION)
        s *= score_scale
        ok = row_ok[:, None] & key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no key yet keeps max -inf; subtracting 0 instead avoids -inf - -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        acc = acc * alpha[:, None] + tl.dot(p.to(q_lat.dtype), latent, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    empty = l_i == 0.0  # this split had no keys
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    row = (q_start + token) * HEADS + head
    if NUM_SPLITS == 1:  # the whole context: the output itself, no merge (nor its buffer)
        dst = out_ptr + row[:, None] * RANK + offs_r[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        part = row * NUM_SPLITS + split
        dst = part_out + part[:, None] * BLOCK_R + offs_r[None, :]
        tl.store(dst, out, mask=row_ok[:, None])
        tl.store(part_lse + part, lse, mask=row_ok)


def _tiles(heads: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_Q): up to ROWS heads of a token, then as many tokens as fill ROWS
    rows (a tl.dot needs MIN_DOT), no more than the longest query has."""
    block_h = min(triton.next_power_of_2(heads), ROWS)
    block_q = min(ROWS // block_h, triton.next_power_of_2(max_query_len))
    return block_h, max(block_q, MIN_DOT // block_h, 1)


def mla_paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    rank: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """[T, H, R]: sequence b's queries q[query_start_loc[b]:query_start_loc[b + 1]]
    ([T, H, R + P], absorbed latent part then rotary part) are its last tokens of
    context_lens[b], each attending causally to the rows of cache [num_blocks,
    block_size, R + P] (its own already written) found through block_tables; the
    values are the rows' first R. `scale` multiplies the scores (an FP8 cache's k_scale
    folded in by the caller, which also scales the output). num_splits (a power of two)
    shares each context between programs; None picks it from the batch and the device."""
    tokens, heads, width = q.shape
    assert q.is_contiguous() and cache.is_contiguous() and cache.shape[-1] == width, (
        q.shape,
        cache.shape,
    )
    block_h, block_q = _tiles(heads, max_query_len)
    tiles = triton.cdiv(max_query_len, block_q) * triton.cdiv(heads, block_h)
    batch = block_tables.shape[0]
    splits = num_splits or splits_to_fill(q.device, batch * tiles, 16)
    block_r = triton.next_power_of_2(rank)
    out = torch.empty(tokens, heads, rank, dtype=q.dtype, device=q.device)
    # split: a share of each context per program, merged after (partials of a few rows:
    # splits are only picked where the programs are few); else written whole
    parts = (tokens, heads, splits) if splits > 1 else (0, 0, 1)
    part_out = torch.empty(*parts, block_r, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(parts, dtype=torch.float32, device=q.device)
    _mla_split_kernel[(batch, tiles, splits)](
        q,
        cache,
        block_tables,
        context_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        block_tables.stride(0),
        HEADS=heads,
        RANK=rank,
        ROPE=width - rank,
        BLOCK_R=block_r,
        BLOCK_P=max(triton.next_power_of_2(width - rank), MIN_DOT),
        BLOCK_H=block_h,
        BLOCK_Q=block_q,
        BLOCK_SIZE=cache.shape[1],
        BLOCK_N=KEY_TILE,
        NUM_SPLITS=splits,
        PRECISION=dot_precision(q.dtype),
    )
    if splits == 1:
        return out
    _decode_merge_kernel[(tokens, heads)](
        part_out,
        part_lse,
        out,
        part_lse,  # no sinks
        1.0,
        HEAD_DIM=rank,
        BLOCK_D=block_r,
        NUM_SPLITS=splits,
        HAS_SINKS=False,
    )
    return out
