"""Few-row products on the CPU, in the form this machine runs fastest.

A decode step multiplies a few rows (a batch's sequences, a verify's k + 1 tokens) by
every weight, and on a CPU what that costs depends on the library's path for those few
rows more than on the weight it reads: torch's float32 F.linear goes to MKL, which on an
AMD EPYC (Zen 4) makes 2 to 4 rows cost 2 to 3x one row, where (weight @ x.T) or oneDNN's
product stay nearer one row's; on an Intel machine `linear` led up to 5 rows
(PERF.md, issue 49). No form wins on every machine, so none is fixed here: the first
product of each (weight shape, rows) times every form on this machine, with weights of
that shape read from memory as a step reads the model's, and the fastest serves that key
for the rest of the process (one form per key: a run's products stay deterministic).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

Form = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

MAX_ROWS = 16  # past this (a prefill) the BLAS's own blocking does well: F.linear
DTYPES = (torch.float32, torch.bfloat16)
REPEATS = 7  # timings of each form per key; the least counts (a busy machine only adds)
# Bytes of weights cycled through while timing, past the last-level cache (32 MiB on the
# EPYC measured), so each product reads its weight from memory as in a step.
STREAM_BYTES = 64 << 20
# Weights under this are timed in place: a tiny model's, which its steps read from cache,
# and whose products cost their calls' overhead more than their reads
IN_PLACE_BYTES = 1 << 20


def _weight_x_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    # the BLAS packs the few rows of x instead of the weight; the copy back keeps the
    # result row-major for whatever reads it next
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


def _weight_x_t_even(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    # MKL reads the weight about half as fast for an odd count of rows (1: a matrix-vector
    # product) as for the next even one on the EPYC measured: a copy of the last row evens it
    rows = x.shape[0]
    if rows % 2:
        x = torch.cat([x, x[-1:]])
    out = torch.mm(weight, x.t())[:, :rows].t().contiguous()
    return out if bias is None else out.add_(bias)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


FORMS: dict[str, Form] = {
    "linear": F.linear,
    "weight @ x.T": _weight_x_t,
    "weight @ x.T, even rows": _weight_x_t_even,
}
if torch.backends.mkldnn.is_available():
    FORMS["oneDNN"] = _onednn

_chosen: dict[tuple[torch.dtype, int, int, int], str] = {}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias), in the measured form on the CPU for up to MAX_ROWS rows
    (x's leading dimensions flattened) of a dtype in DTYPES; F.linear elsewhere."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (
        not 0 < rows <= MAX_ROWS
        or x.device.type != "cpu"
        or x.dtype not in DTYPES
        or weight.dtype != x.dtype
        or not weight.is_contiguous()
        or (torch.is_grad_enabled() and weight.requires_grad)  # the forms have no backward
    ):
        return F.linear(x, weight, bias)
    out = FORMS[chosen_form(weight, rows)](x.reshape(rows, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def chosen_form(weight: torch.Tensor, rows: int) -> str:
    """The name of the form that serves `rows` rows by a weight of this shape and dtype:
    measured at the first call for the key, the same after."""
    key = (weight.dtype, weight.shape[0], weight.shape[1], rows)
    if key not in _chosen:
        times = time_forms(weight, rows)
        _chosen[key] = min(times, key=times.__getitem__)
    return _chosen[key]


def time_forms(weight: torch.Tensor, rows: int, repeats: int = REPEATS) -> dict[str, float]:
    """Each form's least CPU seconds (this thread's: a loaded machine's waits left out)
    for `rows` rows by a weight of `weight`'s shape read from memory: `weight` itself
    where it outsizes STREAM_BYTES (or is under IN_PLACE_BYTES), else that many bytes
    of copies of its shape, one per product in turn. The forms take turns, so a change
    of load hits them alike."""
    size = weight.numel() * weight.element_size()
    if not IN_PLACE_BYTES <= size < STREAM_BYTES:
        weights = weight[None]
    else:  # constant values: no denormals, and the global generator left alone
        weights = torch.full(
            (math.ceil(STREAM_BYTES / size), *weight.shape), 0.5, dtype=weight.dtype
        )
    x = torch.full((rows, weight.shape[1]), 0.25, dtype=weight.dtype)
    times: dict[str, list[float]] = {name: [] for name in FORMS}
    turn = 0
    for repeat in range(repeats + 1):
        for name, form in FORMS.items():
            w = weights[turn % len(weights)]
            turn += 1
            start = time.thread_time()
            form(x, w, None)
            if repeat:  # the first is a warm-up: oneDNN builds its kernel there
                times[name].append(time.thread_time() - start)
    return {name: min(t) for name, t in times.items()}


def choices() -> dict[tuple[torch.dtype, int, int, int], str]:
    """The forms chosen so far in this process, by (dtype, out features, in, rows)."""
    return dict(_chosen)
