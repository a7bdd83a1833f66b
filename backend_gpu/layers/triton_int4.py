"""INT4/INT8 weight-only matmul in Triton, the CUDA path of a packed linear layer
(backend_gpu/quantization/packed.py): y = x @ W, where W is read as the checkpoint keeps
it (32-bit words of 4- or 8-bit integers along K, a scale and a zero point per group of
K rows, GPTQ's g_idx naming each row's group) and widened tile by tile in registers. It
is never widened in memory: a decode step, which reads every weight once, then reads a
quarter of bfloat16's bytes.

One kernel, two inner products, picked by the number of rows:
- a tensor-core tile (tl.dot, BLOCK_M 16 to 64 rows) for prefill and decode batches of
  five rows or more;
- a GEMV shape for one to four rows (a decode of one to four sequences): the widened
  weight tile is multiplied by each row's slice of x and summed over K in registers, with
  no padding of the batch to tl.dot's 16 rows. At these sizes the matmul only streams the
  weight, so the arithmetic is free either way; what the GEMV shape saves is the
  registers and shared memory of the padding, which lets its K tile be longer.
Either way K may be split over programs (the grid's third axis) so a decode, which has
one row tile and N / BLOCK_N column tiles, still gives every SM work; the splits write
float32 partial sums that are added in a fixed order (no atomics: a result does not
change from run to run), as in triton_lora.py. The split count depends on the shapes
and the device only, never on the data, so a step can be captured in a CUDA graph.

Each tile widens q to (q - zero) * scale in float32 and rounds it to x's dtype before the
product, as `dequantize(w, x.dtype)` does, so the kernel equals x @ dequantize(...).T up
to the order of the float32 sums. Where a K tile lies inside one group (no g_idx and a
group size that is a multiple of BLOCK_K, or per-channel) a tile loads one row of scales
and zeros; with g_idx (act order) each of its K rows gathers its own group's row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_gpu.layers.triton_launch import dot_precision, splits_to_fill
from backend_gpu.quantization.packed import PackedWeight

GEMV_MAX_ROWS = 4  # batches up to this many rows take the GEMV shape
MIN_DOT = 16  # tl.dot needs each dimension at least this on a GPU
MAX_TILE_M = 64
TILE_N = 64
MAX_SPLITS = 16


@triton.jit
def _int_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    k_per_split,
    stride_xm,
    stride_os,
    stride_om,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    G_IDX: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (column tile, row tile, split): out[split, rows, cols] = x[rows, share of
    K] @ W[share of K, cols], in out's dtype (float32 partial sums when K is split)."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    PER_WORD: tl.constexpr = 32 // BITS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * k_per_split
    for k in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        kn_ok = k_ok[:, None] & n_ok[None, :]
        # masked lanes read as 0 (x) and scale 0 (w): garbage could be NaN, and 0 * NaN
        # spoils the sum
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # each word is loaded once per row it holds; the repeats hit the cache
        words_at = qweight_ptr + (offs_k // PER_WORD)[:, None] * N + offs_n[None, :]
        words = tl.load(words_at, mask=kn_ok, other=0)
        q = (words >> ((offs_k % PER_WORD) * BITS)[:, None]) & ((1 << BITS) - 1)
        if ONE_GROUP_PER_TILE:
            group_row = (k // group_size) * N + offs_n[None, :]
            scale = tl.load(scales_ptr + group_row, mask=n_ok[None, :], other=0.0)
            zero = tl.load(zeros_ptr + group_row, mask=n_ok[None, :], other=0)
        else:
            if G_IDX:
                groups = tl.load(g_idx_ptr + offs_k, mask=k_ok, other=0)
            else:
                groups = offs_k // group_size
            group_rows = groups[:, None] * N + offs_n[None, :]
            scale = tl.load(scales_ptr + group_rows, mask=kn_ok, other=0.0)
            zero = tl.load(zeros_ptr + group_rows, mask=kn_ok, other=0)
        w = ((q - zero.to(tl.int32)).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
        if DOT:
            acc += tl.dot(x, w, input_precision=PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    dst = out_ptr + split * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tiles(rows: int, dtype: torch.dtype) -> tuple[int, int, bool]:
    """(BLOCK_M, BLOCK_K, whether tl.dot) for a batch of `rows` rows of x in `dtype`."""
    if rows <= GEMV_MAX_ROWS:
        block_m = triton.next_power_of_2(rows)
        return block_m, 128 // block_m, False  # a [BLOCK_M, BLOCK_K, TILE_N] product
    block_m = min(MAX_TILE_M, max(MIN_DOT, triton.next_power_of_2(rows)))
    return block_m, 32 if dtype == torch.float32 else 64, True


def check_packed(x: torch.Tensor, w: PackedWeight) -> None:
    """The layout the kernel reads, or an AssertionError naming what differs."""
    k, n = w.in_features, w.out_features
    assert w.bits in (4, 8), f"bits {w.bits} not in (4, 8)"
    assert x.shape[-1] == k and x.stride(-1) == 1, (x.shape, x.stride(), k)
    assert w.qweight.shape == (k * w.bits // 32, n) and w.qweight.dtype == torch.int32
    groups = w.scales.shape[0]
    assert w.scales.shape == (groups, n) and w.zeros.shape == (groups, n), w.scales.shape
    assert w.zeros.dtype == torch.uint8 and (w.g_idx is None or w.g_idx.shape == (k,))
    for t in (w.qweight, w.scales, w.zeros, w.g_idx):
        assert t is None or (t.is_contiguous() and t.device == x.device), "not contiguous"


def int4_matmul(x: torch.Tensor, w: PackedWeight, num_splits: int | None = None) -> torch.Tensor:
    """x [M, K] @ the packed weight (4 or 8 bits) -> [M, N] in x's dtype. num_splits
    shares K between programs (None: picked from the shapes and the device)."""
    check_packed(x, w)
    rows, k, n = x.shape[0], w.in_features, w.out_features
    if rows == 0:
        return x.new_empty(0, n)
    block_m, block_k, dot = tiles(rows, x.dtype)
    grid_mn = (triton.cdiv(n, TILE_N), triton.cdiv(rows, block_m))
    k_steps = triton.cdiv(k, block_k)
    # each share at least two steps of the K loop
    most = min(k_steps // 2, MAX_SPLITS)
    splits = num_splits or splits_to_fill(x.device, grid_mn[0] * grid_mn[1], most)
    if splits == 1:
        out = torch.empty(1, rows, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    g_idx = w.g_idx
    _int_matmul_kernel[(*grid_mn, splits)](
        x,
        w.qweight,
        w.scales,
        w.zeros,
        g_idx if g_idx is not None else w.zeros,  # not read without G_IDX
        out,
        rows,
        n,
        k,
        w.group_size,
        triton.cdiv(k_steps, splits) * block_k,
        x.stride(0),
        out.stride(0),
        out.stride(1),
        BITS=w.bits,
        BLOCK_M=block_m,
        BLOCK_N=TILE_N,
        BLOCK_K=block_k,
        DOT=dot,
        G_IDX=g_idx is not None,
        ONE_GROUP_PER_TILE=g_idx is None and (w.group_size % block_k == 0 or w.group_size >= k),
        PRECISION=dot_precision(x.dtype),
    )
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)
