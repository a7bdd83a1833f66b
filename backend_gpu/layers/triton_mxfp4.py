"""The experts' grouped GEMM over MXFP4 weights in Triton, the CUDA path of gpt-oss's
packed experts (layers/gpt_oss_moe.py): triton_moe.py's layout (pairs sorted by expert,
each run padded to the row tile, a program multiplies one expert's tile, no host sync),
with the weight tile decoded in registers from the checkpoint's bytes instead of read
in 16 bits, so a step reads 4.25 bits a weight.

A K tile is one MXFP4 group (32 values): one E8M0 scale per output column, loaded once,
and 16 bytes of codes, each byte loaded for the two values it holds (the second load
hits L1, so no shuffle is needed to unpack; triton_int4.py does the same). A code's
value is built exactly in float32: E2M1 is (m + 2 * [e > 0]) * 2^(max(e, 1) - 2) for
exponent bits e and mantissa bit m, and that power of two joins the scale's exponent
in one float32 made from its bits, then rounded to the activations' dtype (exact for
every value a checkpoint's scales give: the products of a 2-bit mantissa and a power of
two), as mxfp4.dequantize does on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_gpu.layers.triton_launch import dot_precision
from backend_gpu.layers.triton_moe import BLOCK_N, ExpertBlocks
from backend_gpu.quantization.mxfp4 import BYTES_PER_GROUP, GROUP, SCALE_BIAS

SCALE_BIAS_IN_KERNEL = tl.constexpr(SCALE_BIAS)  # a kernel reads only constexpr globals


@triton.jit
def _e2m1(code, scale):
    """float32 value of 4-bit codes times 2^(scale - SCALE_BIAS) (scale: int32 E8M0)."""
    e = (code >> 1) & 3
    mantissa = ((code & 1) + tl.where(e > 0, 2, 0)).to(tl.float32)
    # 2^(scale - 127) * 2^(max(e, 1) - 2) as a float32's biased exponent, kept normal
    biased = tl.minimum(tl.maximum(scale - 2 + tl.maximum(e, 1), 1), 254)
    power = (biased << 23).to(tl.float32, bitcast=True)
    value = mantissa * power
    return tl.where(code >= 8, -value, value)


@triton.jit
def _mxfp4_grouped_gemm_kernel(
    a_ptr,  # [rows, K]: row p // A_DIV of pair p
    b_ptr,  # [experts, N, K / 2] uint8: two codes a byte, low nibble first
    s_ptr,  # [experts, N, K / 32] uint8: E8M0 scales
    c_ptr,  # [pairs, N]
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
    stride_se,
    stride_sn,
    stride_cm,
    A_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # one group
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
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    shift = (offs_k % 2) * 4  # the low nibble holds the even value
    b_base = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn
    s_base = s_ptr + expert.to(tl.int64) * stride_se + offs_n * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=real[:, None], other=0.0)
        packed = tl.load(b_base + (ks // 2)[:, None], mask=n_ok[None, :], other=0)
        codes = (packed.to(tl.int32) >> shift[:, None]) & 15  # [BLOCK_K, BLOCK_N]
        scale = tl.load(s_base + k0 // BLOCK_K, mask=n_ok, other=SCALE_BIAS_IN_KERNEL).to(tl.int32)
        b = _e2m1(codes, scale[None, :]).to(a.dtype)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pairs, mask=real, other=0.0)[:, None]
    out = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & n_ok[None, :])


def mxfp4_grouped_gemm(
    a: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    expert_blocks: ExpertBlocks,
    out: torch.Tensor,
    a_div: int,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[p] = a[p // a_div] @ W[expert of p].T (* weights[p]) for each pair p on this
    rank's experts, W the MXFP4 experts of blocks [E, N, K / 32, 16] and scales
    [E, N, K / 32]; other rows of `out` are left as they are."""
    num_experts, n, groups, width = blocks.shape
    assert width == BYTES_PER_GROUP and scales.shape == (num_experts, n, groups)
    assert blocks.is_contiguous() and scales.is_contiguous()
    assert a.stride(1) == 1 and out.stride(1) == 1 and a.shape[1] == groups * GROUP
    grid = (expert_blocks.block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _mxfp4_grouped_gemm_kernel[grid](
        a,
        blocks,
        scales,
        out,
        weights if weights is not None else out,
        expert_blocks.pairs,
        expert_blocks.block_expert,
        out.shape[0],
        num_experts,
        n,
        groups * GROUP,
        a.stride(0),
        blocks.stride(0),
        blocks.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        A_DIV=a_div,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=expert_blocks.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=GROUP,
        PRECISION=dot_precision(a.dtype),
    )
    return out
