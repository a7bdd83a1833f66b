"""Weights in oneDNN's own layout on the CPU, packed once after loading: gpt-oss's
experts and its attention projections.

A decode step multiplies each expert's few rows (16 sequences with top 4 of 16 experts:
about 4 an expert) by every expert's weights, read from memory. oneDNN's linear over a
weight reordered once into its blocked layout streams it faster than MKL's GEMM over the
row-major one: 4 layers of 16 gpt-oss experts (gate/up 1024 x 512, down 512 x 512,
float32, one thread) at 4 rows an expert 15 against 22 ms, at 8 rows 20 against 33, at
64 rows 74 against 104 (PERF.md, "gpt-oss decode: weights packed for oneDNN"). Below
MIN_ROWS rows its few-row kernel is the slower one (the 4 layers' gate/up at 2 rows an
expert: 11.9 ms, MKL 7.2) and 4 to 6 rows cost less (8.6-8.7 ms; 1 row 10.7, as 6 rows
9.3, MKL 14.7): a shorter run is computed as MIN_ROWS rows, the run and its neighbours
in the sorted buffer (their products dropped), with no copy. In the engine (the study's
decode, experts' thread CPU ms a token, medians of 3 and 4 interleaved runs): no
padding 1.56, 4 rows 1.45 and 1.44, 5 rows 1.36, 6 rows 1.36 and 1.37, 8 rows 1.55. The attention's q/k/v
(768 x 512) and o (512 x 512) at a step's 16 rows: 343 and 205 us against MKL's 424
and 327 (cpu_rows' forms take the row-major weight and chose MKL there).

A packed copy replaces what it was packed from, so serving holds the weights once: the
experts' stacked parameters become None (pack_for_cpu), a linear's weight parameter
becomes the packed tensor (same shape and bytes). On the CPU nothing reads them
otherwise after loading (the grouped GEMMs are CUDA's; quantization runs before, and
its 8-bit weights stay as they are).
"""

from __future__ import annotations

import torch
from torch import nn

MIN_ROWS = 6  # a run is computed as at least this many rows (above)
# oneDNN picks the packed layout for this many rows; the products take any count
PACK_ROWS = 16


def packable(weight: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether a stacked expert weight can be packed: on the CPU, float32 or a bfloat16
    that this oneDNN computes, not 8-bit (its row scales are applied by the torch path)."""
    if weight.device.type != "cpu" or scale is not None or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def pack(stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each expert's [out, in] matrix of a stacked [experts, out, in] weight in oneDNN's
    layout for a linear (opaque tensors)."""
    return tuple(
        torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in stacked.detach().unbind(0)
    )


def pack_linear(linear: nn.Linear) -> None:
    """The linear's weight packed in place where it can be (its forward then takes
    packed_linear: layers/linear.py)."""
    if packable(linear.weight, None):
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
        linear.weight = nn.Parameter(packed, requires_grad=False)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """F.linear(x, weight, bias) for a packed weight, x's leading dimensions kept."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def pack_for_cpu(model: nn.Module) -> None:
    """Packs what every module with a `pack_for_cpu` packs (gpt-oss's experts and
    attention)."""
    for module in model.modules():
        if hasattr(module, "pack_for_cpu"):
            module.pack_for_cpu()


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the weights packed in `model`'s modules, which their parameters no
    longer count (memory.parameter_bytes)."""
    return sum(
        w.numel() * w.element_size()
        for module in model.modules()
        for weights in (getattr(module, "packed", None) or {}).values()
        for w in weights
    )


def packed_runs(
    weights: tuple[torch.Tensor, ...],
    biases: torch.Tensor | None,
    rows: torch.Tensor,
    runs: list[int],
) -> torch.Tensor:
    """[rows, out]: each run of `rows` ([rows, in], sorted by expert, runs[e] of expert e,
    at least one run not empty) times its expert's packed weight, plus its bias
    (`biases` [experts, out]). The runs' products are joined by one cat: oneDNN's linear
    writes no given buffer, and a copy per run into one cost more (4 layers' gate/up at
    a decode step, 11.65 against 11.33 ms)."""
    total = rows.shape[0]
    bias = biases.unbind(0) if biases is not None else None
    parts, start = [], 0
    for e, run in enumerate(runs):
        if not run:
            continue
        # a short run with the rows after it (before it, at the end of the buffer)
        first = max(0, min(start, total - MIN_ROWS))
        last = min(total, max(start + run, first + MIN_ROWS))
        y = torch.ops.mkldnn._linear_pointwise(
            rows[first:last], weights[e], None if bias is None else bias[e], "none", [], ""
        )
        parts.append(y[start - first : start - first + run])
        start += run
    return torch.cat(parts)
