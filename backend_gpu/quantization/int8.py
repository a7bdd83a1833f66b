"""INT8 weights, symmetric, one scale per output channel (weight-only)."""

from __future__ import annotations

import torch

from backend_gpu.distributed import SINGLE, ParallelGroup

INT8_MAX = 127  # symmetric: -128 is left unused


# values quantized at once (4 MB of float32): each pass over a block stays in the cache,
# where a pass over a whole token table (Gemma 3's 168M values) made and page-faulted a
# temporary of its size, four times over
VALUES_AT_ONCE = 1 << 20


def quantize_per_channel(
    weight: torch.Tensor, rows_over: ParallelGroup = SINGLE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale [out]) with weight ~= int8 * scale[:, None]; the scale
    is rounded to the weight's dtype first: the forward casts it to that dtype losslessly.
    A row-parallel weight's rows are split over `rows_over`: the scale is the whole row's.
    Computed a block of rows at a time; a row's own figures are the same either way."""
    rows_at_once = max(1, VALUES_AT_ONCE // max(1, weight.shape[1]))
    blocks = [rows.float() for rows in weight.split(rows_at_once)]
    amax = rows_over.max_over_ranks(torch.cat([w.abs().amax(dim=1) for w in blocks]))
    scale = (amax.clamp(min=1e-12) / INT8_MAX).to(weight.dtype).float()
    q = [
        (w / s[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        for w, s in zip(blocks, scale.split(rows_at_once), strict=True)
    ]
    return torch.cat(q), scale
