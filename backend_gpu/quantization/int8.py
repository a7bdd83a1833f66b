"""INT8 weights, symmetric, one scale per output channel (weight-only)."""

from __future__ import annotations

import torch

from backend_gpu.distributed import SINGLE, ParallelGroup

INT8_MAX = 127  # symmetric: -128 is left unused


def quantize_per_channel(
    weight: torch.Tensor, rows_over: ParallelGroup = SINGLE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale [out]) with weight ~= int8 * scale[:, None]; the scale
    is rounded to the weight's dtype first: the forward casts it to that dtype losslessly.
    A row-parallel weight's rows are split over `rows_over`: the scale is the whole row's."""
    w = weight.float()
    amax = rows_over.max_over_ranks(w.abs().amax(dim=1))
    scale = (amax.clamp(min=1e-12) / INT8_MAX).to(weight.dtype).float()
    q = (w / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale
