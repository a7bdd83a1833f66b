"""Batched LoRA in Triton, the CUDA path: every token of a step runs under its own
adapter (or none), and one launch per projection applies them all. Punica's idea (SGMV,
BGMV): the kernels gather each token's adapter matrices from a stack of resident slots,
so a batch mixing eight adapters costs about what one adapter would, not eight launches.

    shrink: t[T, R] = x[T, K] @ a[idx]^T          (a: [S, R, K], the LoRA A matrices)
    expand: y[T, N] += scale[idx] * t @ b[idx]^T  (b: [S, N, R], the LoRA B matrices)

One kernel per op that tiles for decode and prefill alike (SGMV's segments rather than
a GEMV-shaped BGMV launch for short batches): the tokens are sorted by slot on the
device (no host sync, so a step can be captured in a CUDA graph), and a program takes a
tile of one slot's tokens, so each adapter's matrices are read once per tile of its
tokens, where a token-per-program GEMV reads them once per token (sixteen decode tokens
on one adapter: one read, not sixteen). The grid is sized for the worst case (every
token on every slot); programs past a slot's tokens return at once. A tile is at least
16 rows, as tl.dot needs: a decode's tile is mostly padding, which costs little where
reading the weights, not the arithmetic, is the cost. The shrink's reduction (K up to
16384) is split over programs so a decode batch still fills the GPU; the splits'
partial sums are added in a fixed order (not atomics), so a result does not change from
run to run. The expand needs no split: R (at most 128) is one tile deep, and N gives the
parallelism. The sort is the same for every projection of a step: a caller may make it
once (group_by_adapter) and pass it to each call. Its speed on a GPU is not measured
yet (docs/PERF.md, "LoRA kernels").

Accumulation is float32. The shrink's dot is in x's dtype (float32 when x or a is); the
expand's is in b's dtype with t rounded to it first, as PEFT's lora_B(lora_A(x)) rounds
its intermediate. lora_shrink_ref and lora_expand_ref are the same math in torch, the
reference the tests hold the kernels to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backend_gpu.layers.triton_launch import dot_precision, splits_to_fill

MIN_DOT = 16  # tl.dot needs each dimension at least this on a GPU
MAX_TILE_M = 64  # tokens per program
EXPAND_TILE_N = 64  # outputs per expand program
MAX_RANK = 128


@dataclass(frozen=True)
class AdapterGroups:
    """A step's tokens grouped by adapter slot, on the device: what the kernels' programs
    find their tokens by. The same for every projection of a step, so a caller may make
    it once (group_by_adapter) and pass it to each call."""

    order: torch.Tensor  # [T] int32: token indices sorted by slot, no-adapter tokens first
    counts: torch.Tensor  # [S] int32: tokens on each slot
    starts: torch.Tensor  # [S] int32: where each slot's tokens begin in `order`


def group_by_adapter(idx: torch.Tensor, num_slots: int) -> AdapterGroups:
    """idx [T] int32 (slot of each token, -1 for none) grouped, without a host sync."""
    order = torch.argsort(idx, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=idx.device)
    counts.index_add_(0, idx.long() + 1, torch.ones_like(idx, dtype=torch.int32))
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    return AdapterGroups(order, counts[1:], starts[1:])


@triton.jit
def _slot_tokens(order_ptr, counts_ptr, starts_ptr, slot, tile, BLOCK_M: tl.constexpr):
    """(token indices [BLOCK_M] int64, which are real, whether the tile has any)."""
    count = tl.load(counts_ptr + slot)
    offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = offs < count
    tokens = tl.load(order_ptr + tl.load(starts_ptr + slot) + offs, mask=ok, other=0)
    return tokens.to(tl.int64), ok, tile * BLOCK_M < count


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    order_ptr,
    counts_ptr,
    starts_ptr,
    K,
    R,
    k_per_split,
    stride_xt,
    stride_as,
    stride_ar,
    stride_os,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (split, tile, slot): a tile of the slot's tokens over one share of K;
    writes its partial sums to out[split]."""
    split, tile, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tokens, m_ok, busy = _slot_tokens(order_ptr, counts_ptr, starts_ptr, slot, tile, BLOCK_M)
    if not busy:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
    x_rows = x_ptr + tokens[:, None] * stride_xt
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    k_lo = split * k_per_split
    for k in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        # masked lanes read as 0: garbage there could be NaN, and 0 * NaN spoils the dot
        xt = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_rows + offs_k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if WIDE:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        acc += tl.dot(xt, at.to(xt.dtype), input_precision=PRECISION)
    dst = out_ptr + split * stride_os + tokens[:, None] * stride_ot + offs_r[None, :]
    tl.store(dst, acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    y_ptr,
    t_ptr,
    b_ptr,
    scale_ptr,
    order_ptr,
    counts_ptr,
    starts_ptr,
    N,
    R,
    stride_yt,
    stride_tt,
    stride_bs,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (column tile, token tile, slot): y's tile += scale * t's rows @ b's tile."""
    col, tile, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tokens, m_ok, busy = _slot_tokens(order_ptr, counts_ptr, starts_ptr, slot, tile, BLOCK_M)
    if not busy:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    t_ptrs = t_ptr + tokens[:, None] * stride_tt + offs_r[None, :]
    tt = tl.load(t_ptrs, mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None]
    bt = tl.load(b_ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    acc = tl.dot(tt.to(bt.dtype), bt, input_precision=PRECISION) * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _tile_m(num_tokens: int) -> int:
    return min(MAX_TILE_M, max(MIN_DOT, triton.next_power_of_2(num_tokens)))


def _num_splits(device: torch.device, token_tiles: int, k_steps: int) -> int:
    """Shares of K so a short batch has programs for every SM twice over, each share
    at least four steps of the K loop."""
    return splits_to_fill(device, token_tiles, min(k_steps // 4, 64))


def _check_rows(*tensors: torch.Tensor) -> None:
    assert all(t.stride(-1) == 1 for t in tensors), "the last dimension must be contiguous"


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    idx: torch.Tensor,
    groups: AdapterGroups | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """[T, R] float32: row t is x[t] @ a[idx[t]]^T, zeros where idx[t] is -1. x [T, K],
    a [S, R, K] (R up to 128), idx [T] int32. num_splits shares K between programs
    (None: picked from the batch and the device)."""
    (num_tokens, k), (num_slots, rank, _) = x.shape, a.shape
    assert a.shape[2] == k and rank <= MAX_RANK and idx.shape == (num_tokens,), (x.shape, a.shape)
    _check_rows(x, a)
    if num_tokens == 0:
        return torch.zeros(0, rank, dtype=torch.float32, device=x.device)
    groups = groups or group_by_adapter(idx, num_slots)
    wide = torch.promote_types(x.dtype, a.dtype) == torch.float32
    block_m, block_k = _tile_m(num_tokens), 32 if wide else 64
    token_tiles = triton.cdiv(num_tokens, block_m)
    splits = num_splits or _num_splits(x.device, token_tiles, triton.cdiv(k, block_k))
    out = torch.zeros(splits, num_tokens, rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(splits, token_tiles, num_slots)](
        x,
        a,
        out,
        groups.order,
        groups.counts,
        groups.starts,
        k,
        rank,
        triton.cdiv(triton.cdiv(k, splits), block_k) * block_k,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_R=max(MIN_DOT, triton.next_power_of_2(rank)),
        BLOCK_K=block_k,
        WIDE=wide,
        PRECISION=dot_precision(torch.float32 if wide else x.dtype),
    )
    return out[0] if splits == 1 else out.sum(0)


def lora_expand(
    y: torch.Tensor,
    t: torch.Tensor,
    b: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor,
    groups: AdapterGroups | None = None,
) -> None:
    """y[i] += scale[idx[i]] * t[i] @ b[idx[i]]^T in place, for the rows with idx >= 0
    (the others untouched). y [T, N] (a column slice of a wider output will do: its row
    stride is respected), t [T, R], b [S, N, R], idx [T] int32, scale [S] float32."""
    (num_tokens, n), (num_slots, _, rank) = y.shape, b.shape
    assert b.shape[1] == n and t.shape == (num_tokens, rank) and rank <= MAX_RANK
    assert scale.shape == (num_slots,) and scale.dtype == torch.float32
    _check_rows(y, t, b)
    if num_tokens == 0:
        return
    groups = groups or group_by_adapter(idx, num_slots)
    block_m = _tile_m(num_tokens)
    grid = (triton.cdiv(n, EXPAND_TILE_N), triton.cdiv(num_tokens, block_m), num_slots)
    _expand_kernel[grid](
        y,
        t,
        b,
        scale,
        groups.order,
        groups.counts,
        groups.starts,
        n,
        rank,
        y.stride(0),
        t.stride(0),
        b.stride(0),
        b.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=EXPAND_TILE_N,
        BLOCK_R=max(MIN_DOT, triton.next_power_of_2(rank)),
        PRECISION=dot_precision(b.dtype),
    )


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """lora_shrink in torch, one adapter at a time, in float32 (from the dot's dtype)."""
    dot = torch.promote_types(x.dtype, a.dtype)
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot in idx.unique().tolist():
        if slot >= 0:
            rows = idx == slot
            out[rows] = x[rows].to(dot).float() @ a[slot].to(dot).float().T
    return out


def lora_expand_ref(
    y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor
) -> None:
    """lora_expand in torch, one adapter at a time: t rounded to b's dtype, then float32."""
    for slot in idx.unique().tolist():
        if slot >= 0:
            rows = idx == slot
            delta = t[rows].to(b.dtype).float() @ b[slot].float().T * scale[slot]
            y[rows] = (y[rows].float() + delta).to(y.dtype)
