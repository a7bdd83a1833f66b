"""Paged attention in Triton, the CUDA path: the kernels read K and V straight from the
paged cache through each sequence's block table, so nothing is gathered into a
workspace first (the torch path in attention.py gathers; it stays the CPU path and the
reference these kernels are tested against).

One inner loop serves both kernels: a tile of query rows against a range of keys, key
tiles looked up slot by slot in the block table (so a tile may span several cache
blocks of any size), an online softmax in base 2, causal and sliding-window masks by
position. GQA: a program takes every query head of one KV head as rows, so each key
tile is loaded once for the group. An FP8 cache is widened to the query's dtype in the
kernel; K's scale joins the score scale and V's multiplies the output. Attention sinks
(gpt-oss: a logit per query head in the softmax's denominator, attending to nothing)
join the sum after the keys: in the prefill kernel's final normalization, in the decode
merge's (so the splits need not know of them).

- Decode (one query per sequence) splits each context over programs (flash decoding):
  short batches still fill the GPU, and a second kernel merges the splits by their
  log-sum-exp.
- Prefill, chunked prefill and speculative verification are one kernel: each
  sequence's new queries (cu_seqlens-style offsets) attend causally to its cached
  context, their own keys included (already written to the cache); rows given a
  `key_last` past themselves (a Gemma 3 image's tokens) see that far ahead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_gpu.layers.triton_launch import dot_precision, splits_to_fill

LOG2E = 1.4426950408889634
LOG2E_IN_KERNEL = tl.constexpr(LOG2E)  # a kernel reads only constexpr globals
KEY_TILE = 64  # keys per inner-loop step
PREFILL_ROWS = 64  # query rows (tokens x heads of a group) per prefill program
MIN_DOT = 16  # tl.dot needs each dimension at least this on a GPU


@triton.jit
def _widen(x, dtype: tl.constexpr):
    """x in `dtype`; FP8 by way of float32: Triton 3.6 turns FP8 into bfloat16 with a
    conversion only sm_90 has, which fails to build for Ada."""
    if x.dtype.is_fp8():
        x = x.to(tl.float32)
    return x.to(dtype)


@triton.jit
def _attend(
    q,
    q_pos,
    q_last,  # the last key position each row sees [M]: its own, or past it (key_last)
    row_ok,  # queries [M, D], their positions [M], which rows are real [M]
    k_cache,
    v_cache,
    table_ptr,
    kv_head,
    key_lo,
    key_hi,
    window,
    score_scale,
    slot_stride,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(acc, max, sum): the online softmax (base 2) of q's rows over keys [key_lo, key_hi)."""
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    acc = tl.zeros([q.shape[0], BLOCK_D], tl.float32)
    m_i = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([q.shape[0]], tl.float32)
    for start in range(key_lo, key_hi, BLOCK_N):
        key_pos = start + offs_n
        key_ok = key_pos < key_hi
        block = tl.load(table_ptr + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + key_pos % BLOCK_SIZE
        rows = slot * slot_stride + kv_head * HEAD_DIM
        k_mask = key_ok[None, :] & d_ok[:, None]
        # masked lanes read as 0: garbage there could be NaN, and 0 * NaN spoils the dots
        k = tl.load(k_cache + rows[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
        s = tl.dot(q, _widen(k, q.dtype), input_precision=PRECISION) * score_scale
        ok = row_ok[:, None] & key_ok[None, :] & (key_pos[None, :] <= q_last[:, None])
        if USE_WINDOW:
            ok &= key_pos[None, :] > q_pos[:, None] - window
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no key yet keeps max -inf; subtracting 0 instead avoids -inf - -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v_mask = key_ok[:, None] & d_ok[None, :]
        v = tl.load(v_cache + rows[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        pv = tl.dot(p.to(q.dtype), _widen(v, q.dtype), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache,
    v_cache,
    tables_ptr,
    lens_ptr,
    part_out,
    part_lse,
    score_scale,
    window,
    stride_qb,
    stride_tb,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (sequence, KV head, split): the group's query heads over one share of the
    context; writes the normalized partial output and its log-sum-exp (base 2)."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    ctx = tl.load(lens_ptr + seq)
    first = 0
    if USE_WINDOW:  # a window reads only the blocks it reaches into
        first = tl.maximum(ctx - window, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    key_lo = first + split * per_split
    key_hi = tl.minimum(key_lo + per_split, ctx)

    offs_h, offs_d = tl.arange(0, ROWS), tl.arange(0, BLOCK_D)
    row_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    q_pos = tl.zeros([ROWS], tl.int32) + ctx - 1
    acc, m_i, l_i = _attend(
        q,
        q_pos,
        q_pos,
        row_ok,
        k_cache,
        v_cache,
        tables_ptr + seq * stride_tb,
        kv_head,
        key_lo,
        key_hi,
        window,
        score_scale,
        num_kv_heads * HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_D,
        USE_WINDOW,
        PRECISION,
    )
    empty = l_i == 0.0  # this split had no keys
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    part = (seq * GROUP * num_kv_heads + heads) * NUM_SPLITS + split
    tl.store(part_out + part[:, None] * BLOCK_D + offs_d[None, :], out, mask=row_ok[:, None])
    tl.store(part_lse + part, lse, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    part_out,
    part_lse,
    out_ptr,
    sinks_ptr,  # [heads] (HAS_SINKS)
    v_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Program (sequence, query head): the splits weighted by their share of the softmax."""
    row = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    offs_s, offs_d = tl.arange(0, NUM_SPLITS), tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse + row * NUM_SPLITS + offs_s)
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    parts = tl.load(part_out + (row * NUM_SPLITS + offs_s)[:, None] * BLOCK_D + offs_d[None, :])
    total = tl.sum(weight, 0)
    if HAS_SINKS:  # the sink's share of the denominator, in the splits' base-2 units
        sink = tl.load(sinks_ptr + tl.program_id(1)).to(tl.float32) * LOG2E_IN_KERNEL
        total += tl.exp2(sink - top)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total) * v_scale
    dst = out_ptr + row * HEAD_DIM + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr,
    out_ptr,
    k_cache,
    v_cache,
    tables_ptr,
    lens_ptr,
    q_starts_ptr,
    sinks_ptr,  # [heads] (HAS_SINKS)
    key_last_ptr,  # [T] the last key position each row sees (HAS_KEY_LAST)
    score_scale,
    v_scale,
    window,
    stride_qt,
    stride_tb,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_KEY_LAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (sequence, query tile, KV head): BLOCK_Q new tokens x the group's heads as
    rows, over the keys any of them may see."""
    seq, tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_kv_heads = tl.num_programs(2)
    q_start = tl.load(q_starts_ptr + seq)
    q_len = tl.load(q_starts_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(lens_ptr + seq)
    first_pos = ctx - q_len + tile * BLOCK_Q  # position of the tile's first query
    key_hi = tl.minimum(first_pos + BLOCK_Q, ctx)
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(first_pos - window + 1, 0)

    offs_m, offs_d = tl.arange(0, BLOCK_Q * GROUP_PAD), tl.arange(0, BLOCK_D)
    token = tile * BLOCK_Q + offs_m // GROUP_PAD
    in_group = offs_m % GROUP_PAD
    row_ok = (token < q_len) & (in_group < GROUP)
    heads = kv_head * GROUP + in_group
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_rows = (q_start + token) * stride_qt + heads * HEAD_DIM
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    q_pos = ctx - q_len + token
    q_last = q_pos
    if HAS_KEY_LAST:  # rows that see past themselves: the tile reads as far as they see
        q_last = tl.load(key_last_ptr + q_start + token, mask=token < q_len, other=0).to(tl.int32)
        q_last = tl.maximum(q_last, q_pos)
        key_hi = tl.minimum(tl.maximum(key_hi, tl.max(q_last, 0) + 1), ctx)
    acc, m_i, l_i = _attend(
        q,
        q_pos,
        q_last,
        row_ok,
        k_cache,
        v_cache,
        tables_ptr + seq * stride_tb,
        kv_head,
        key_lo,
        key_hi,
        window,
        score_scale,
        num_kv_heads * HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_D,
        USE_WINDOW,
        PRECISION,
    )
    if HAS_SINKS:  # each row's head's sink joins the denominator (base 2, as m_i)
        sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E_IN_KERNEL
        l_i += tl.exp2(sink - m_i)  # a row with no keys (m_i -inf) gets inf: its acc is 0
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
    o_rows = (q_start + token) * num_kv_heads * GROUP * HEAD_DIM + heads * HEAD_DIM
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(block size, query heads per KV head); the layouts the kernels' addressing assumes."""
    _, block_size, kv_heads, dim = k_cache.shape
    assert v_cache.shape == k_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.shape[-1] == dim and q.shape[-2] % kv_heads == 0, (q.shape, k_cache.shape)
    assert q.stride(-1) == 1 and q.stride(-2) == dim, "each query row's heads must be contiguous"
    return block_size, q.shape[-2] // kv_heads


def _num_splits(device: torch.device, programs: int) -> int:
    """Splits of each context so a decode batch has programs for every SM twice over."""
    return splits_to_fill(device, programs, 16)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, Hq, D]: one query per sequence, q [B, Hq, D], over its context_lens[b] keys in
    k_cache, v_cache [num_blocks, block_size, Hkv, D] (holding k / k_scale, v / v_scale)
    found through block_tables [B, max_blocks]. num_splits (a power of two) shares each
    context between programs; None picks it from the batch and the device. sinks [Hq]:
    a logit per query head in the softmax's denominator."""
    block_size, group = _check(q, k_cache, v_cache)
    batch, heads, dim = q.shape
    splits = num_splits or _num_splits(q.device, batch * k_cache.shape[2])
    block_d = triton.next_power_of_2(dim)
    part_out = torch.empty(batch, heads, splits, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, k_cache.shape[2], splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        part_out,
        part_lse,
        scale * k_scale * LOG2E,
        sliding_window or 0,
        q.stride(0),
        block_tables.stride(0),
        GROUP=group,
        ROWS=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=KEY_TILE,
        NUM_SPLITS=splits,
        USE_WINDOW=sliding_window is not None,
        PRECISION=dot_precision(q.dtype),
    )
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    _decode_merge_kernel[(batch, heads)](
        part_out,
        part_lse,
        out,
        sinks if sinks is not None else part_lse,
        v_scale,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        HAS_SINKS=sinks is not None,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
    key_last: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, Hq, D]: sequence b's queries q[query_start_loc[b]:query_start_loc[b + 1]] are
    its last tokens of context_lens[b] (their keys already in the cache), each attending
    causally (and within the window) to its sequence's keys, read as in decode. sinks
    [Hq]: a logit per query head in the softmax's denominator. key_last [T]: the last key
    position each row sees, where some see past themselves (never past the context)."""
    block_size, group = _check(q, k_cache, v_cache)
    group_pad = triton.next_power_of_2(group)
    # short queries (speculative verification) get short tiles; a tile is >= MIN_DOT rows
    block_q = min(max(PREFILL_ROWS // group_pad, 1), triton.next_power_of_2(max_query_len))
    block_q = max(block_q, MIN_DOT // group_pad, 1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (block_tables.shape[0], triton.cdiv(max_query_len, block_q), k_cache.shape[2])
    _prefill_kernel[grid](
        q,
        out,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        sinks if sinks is not None else out,
        key_last if key_last is not None else query_start_loc,
        scale * k_scale * LOG2E,
        v_scale,
        sliding_window or 0,
        q.stride(0),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=q.shape[-1],
        BLOCK_D=triton.next_power_of_2(q.shape[-1]),
        BLOCK_SIZE=block_size,
        BLOCK_N=KEY_TILE,
        USE_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        HAS_KEY_LAST=key_last is not None,
        PRECISION=dot_precision(q.dtype),
    )
    return out
