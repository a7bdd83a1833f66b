"""FP8 E4M3: per-channel weight quantization, and the W8A8 matmul on GPUs that have
FP8 tensor cores (Ada, Hopper and later) with per-token activation scales."""

from __future__ import annotations

import torch

from backend_gpu.distributed import SINGLE, ParallelGroup

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12  # an all-zero row or token still gets a usable scale


def to_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale in FP8, saturated: casting a value past the range would give NaN."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


# widen_scaled's values are the FP8 ones times this (a power of two: exact both ways)
WIDEN_SCALE = 2.0**-8


def widen_scaled(q: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 values times WIDEN_SCALE in float16, exactly, for every finite code: the
    sign and the seven exponent-and-mantissa bits moved into float16's places, so E4M3's
    exponent (bias 7) reads with float16's bias of 15, and its subnormals land on float16's.
    torch widens E4M3 one value at a time on the CPU (about 4 ns each: ten times the
    matmul of a decode step's few rows); these three integer passes are vectorized, about
    10x faster. The two NaN codes read as +-480, which saturated weights never hold."""
    bits = q.view(torch.int8).to(torch.int16).bitwise_left_shift_(7)
    return bits.bitwise_and_(~0x4000).view(torch.float16)  # the sign's copy out of the exponent


# where each row's largest weight may land, as fractions of FP8_MAX: E4M3's grid is
# relative, so moving the row across it changes which weights round well. The best of
# these per row cut the weights' error by 10% on Gemma 3 270M (2.64% -> 2.38% RMS).
ROW_MAX_TARGETS = torch.linspace(0.75, 1.0, 11).tolist()


# rows quantized at once: each candidate scale's pass over a block of rows (640 kB of
# float32 at Gemma 3's width) stays in the cache, where a pass over a whole 262k-row
# table made and page-faulted half a dozen 670 MB temporaries, eleven times over
ROWS_AT_ONCE = 256


def quantize_per_channel(
    weight: torch.Tensor, rows_over: ParallelGroup = SINGLE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale [out]) with weight ~= fp8 * scale[:, None], each row's
    scale the one of ROW_MAX_TARGETS with the least squared error (the first such).
    Scales are rounded to the weight's dtype first: the forward casts them to that dtype
    losslessly. A row-parallel weight's rows are split over the ranks of `rows_over`:
    its scales are those of the whole rows, as on one device. Each row's figures are
    computed ROWS_AT_ONCE rows at a time; a row's own are the same either way."""
    blocks = [rows.float() for rows in weight.split(ROWS_AT_ONCE)]
    amax = torch.cat([w.abs().amax(dim=1) for w in blocks])
    amax = rows_over.max_over_ranks(amax).clamp(min=MIN_SCALE)
    scales = torch.stack(
        [(amax / (FP8_MAX * target)).to(weight.dtype).float() for target in ROW_MAX_TARGETS]
    )
    errors = torch.cat(
        [
            torch.stack([_squared_error(w, s) for s in row_scales])
            for w, row_scales in zip(blocks, scales.split(ROWS_AT_ONCE, dim=1), strict=True)
        ],
        dim=1,
    )
    best = rows_over.sum_over_ranks(errors).argmin(dim=0)  # the first of equal errors
    best_scale = scales.gather(0, best[None])[0]
    q = [to_fp8(w, s[:, None]) for w, s in zip(blocks, best_scale.split(ROWS_AT_ONCE), strict=True)]
    return torch.cat(q), best_scale


def _squared_error(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per row of w, the squared error of its FP8 values at `scale` [rows]."""
    return (widened(to_fp8(w, scale[:, None])) * scale[:, None] - w).square().sum(dim=1)


def widened(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 values in `dtype`, by widen_scaled on the CPU."""
    if q.device.type != "cpu":
        return q.to(dtype)
    return widen_scaled(q).to(dtype) * (1 / WIDEN_SCALE)


def supports_w8a8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_kv_cache(device: torch.device) -> None:
    """A clear error, not a kernel build failure at the first step: on CUDA the attention
    kernels read E4M3 with the conversions of Ada, Hopper and later (Triton has none for
    it on older GPUs); the CPU's torch path reads it anywhere."""
    if device.type == "cuda" and not supports_w8a8(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            "kv_cache_dtype 'fp8' needs a GPU of compute capability 8.9 or later "
            f"(Ada, Hopper); this one is {major}.{minor}"
        )


def w8a8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T on FP8 tensor cores: x [..., in] (bfloat16) quantized per token on the
    fly; weight [out, in] FP8 with float32 per-channel scales [out]."""
    x2 = x.reshape(-1, x.shape[-1])
    x_scale = x2.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_SCALE) / FP8_MAX
    out = torch._scaled_mm(
        to_fp8(x2, x_scale),
        weight.t(),  # [in, out] column-major, the layout _scaled_mm wants for its 2nd operand
        scale_a=x_scale,  # [T, 1]
        scale_b=weight_scale.view(1, -1),  # [1, out]
        out_dtype=x.dtype,
    )
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], -1)
