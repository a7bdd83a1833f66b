"""The experts' grouped GEMM in Triton, the CUDA path of layers/moe.py: every expert's
matmul over its own tokens in one launch (vLLM's fused_moe layout).

The step's (token, slot) pairs are sorted by expert on the device and each expert's run
is padded to a multiple of the row tile (`align_by_expert`), so a program's BLOCK_M
rows all belong to one expert: it reads those rows of the input (gathered through the
pair indices, no copy), that expert's weight tiles, and writes its output rows back to
the pairs' own places. No host sync: the launch grid is the bound on the padded rows
(pairs + experts * (BLOCK_M - 1)) and programs past the real blocks return at once, so
decodes stay in CUDA graphs. Experts held by another rank (expert parallel) sort last
and get no block; their pairs' rows stay zero.

Two launches per layer: gate_up over the tokens' hidden states, then (after silu * up)
down over the intermediate rows with each pair's routing weight applied; the k rows of
a token are summed in float32. 8-bit expert weights (FP8 or INT8) are widened in the
kernel by way of float32 and their per-row scales applied to the accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from backend_gpu.layers.triton_launch import dot_precision

BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: row p // A_DIV of pair p
    b_ptr,  # [experts, N, K]
    c_ptr,  # [pairs, N]
    scale_ptr,  # [experts, N] float32 (HAS_SCALE)
    weight_ptr,  # [pairs] float32 routing weights (MUL_WEIGHT)
    pairs_ptr,  # [padded] int32 pair of each sorted row; num_pairs: padding
    block_expert_ptr,  # [blocks] int32 expert of each row tile; >= num_experts: none
    num_pairs,
    num_experts,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_se,
    A_DIV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    real = pairs < num_pairs
    rows = tl.where(real, pairs // A_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + ks[None, :],
            mask=real[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_base + offs_n[None, :] * stride_bn + ks[:, None],
            mask=(offs_n[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        b = b.to(tl.float32).to(a.dtype)  # 8-bit weights widened by way of float32
        acc += tl.dot(a, b, input_precision=PRECISION)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + expert * stride_se + offs_n, mask=offs_n < N, other=0.0)
        acc *= scale[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pairs, mask=real, other=0.0)[:, None]
    out = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & (offs_n[None, :] < N))


@dataclass(frozen=True)
class ExpertBlocks:
    """The pairs sorted by expert, each expert's run padded to a multiple of block_m."""

    pairs: torch.Tensor  # [blocks * block_m] int32 pair index; num_pairs marks padding
    block_expert: torch.Tensor  # [blocks] int32 expert of each tile; num_experts: none
    block_m: int


def align_by_expert(local: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Tile layout of pairs whose (local) expert is `local` [pairs]; `num_experts` marks
    a pair of an expert held elsewhere. Device ops only: no host sync."""
    num_pairs, device = local.numel(), local.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    starts = counts.cumsum(0) - counts
    order = local.argsort(stable=True)
    expert = local[order]
    held = expert < num_experts
    safe = torch.where(held, expert, 0)
    rank = torch.arange(num_pairs, device=device) - starts[safe]
    blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    dest = torch.where(held, padded_ends[safe] - padded[safe] + rank, blocks * block_m)
    pairs = torch.full((blocks * block_m + 1,), num_pairs, dtype=torch.int32, device=device)
    pairs.scatter_(0, dest, order.to(torch.int32))
    tile_starts = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, tile_starts, right=True).to(torch.int32)
    return ExpertBlocks(pairs[:-1], block_expert, block_m)


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor | None,
    blocks: ExpertBlocks,
    out: torch.Tensor,
    a_div: int,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[p] = a[p // a_div] @ b[expert of p].T (* scale, * weights[p]) for each pair p
    on this rank's experts; other rows of `out` are left as they are."""
    num_experts, n, k = b.shape
    assert a.stride(1) == 1 and b.stride(2) == 1 and out.stride(1) == 1
    grid = (blocks.block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a,
        b,
        out,
        scale if scale is not None else out,
        weights if weights is not None else out,
        blocks.pairs,
        blocks.block_expert,
        out.shape[0],
        num_experts,
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        scale.stride(0) if scale is not None else 0,
        A_DIV=a_div,
        HAS_SCALE=scale is not None,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=blocks.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION=dot_precision(a.dtype),
    )
    return out


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Row tile: 16 while experts average few rows (decodes), 64 for prefill chunks."""
    return 16 if num_pairs <= 16 * num_experts else 64


@dataclass(frozen=True)
class ExpertWeights:
    """One rank's experts (layers/moe.py's FusedExperts): gate_up [E, 2I, H], down
    [E, H, I], and their per-row scales when 8-bit."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None
    down_scale: torch.Tensor | None


def fused_experts(
    x: torch.Tensor, experts: ExpertWeights, weights: torch.Tensor, local: torch.Tensor
) -> torch.Tensor:
    """[T, H]: each token's experts' outputs weighted and summed. `local` [T, k]: the
    experts as indices into this rank's (E: held elsewhere)."""
    tokens, k = local.shape
    count = experts.gate_up.shape[0]
    blocks = align_by_expert(local.flatten(), count, block_m_for(local.numel(), count))
    h = torch.empty(tokens * k, experts.gate_up.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(x, experts.gate_up, experts.gate_up_scale, blocks, h, a_div=k)
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    out = torch.zeros(tokens * k, x.shape[-1], dtype=torch.float32, device=x.device)
    grouped_gemm(act, experts.down, experts.down_scale, blocks, out, 1, weights.flatten().float())
    return out.view(tokens, k, -1).sum(dim=1).to(x.dtype)
