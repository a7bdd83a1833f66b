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

Measuring is paid once a machine, not once a process: the choices are kept in a file of
the kvgate cache named by the CPU, torch's version and the forms, and a process takes a
key from there before it times one. Every engine process on the machine (a server, its
workers and ranks, the test suite's hundreds) then multiplies as the first did, and
none spends seconds timing an LM head's forms (Gemma 3's 262k rows: 16 row counts x
four forms x eight products of 671 MB each, where a slice now stands in for it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from backend_gpu.gguf_loader import cache_root
from backend_gpu.layers import cpu_kernels

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
# A weight past STREAM_BYTES is timed on row slices of this size cycled over STREAM_BYTES
# of it (still read from memory): the forms differ in how they take the few rows, which a
# slice shows as the whole does, at a fraction of an LM head's reads
SLICE_BYTES = 8 << 20
CHOICES_FILE_BYTES = 1 << 20  # a choices file past this is not read (and is rewritten)


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
    if x.dtype == torch.bfloat16 and not _onednn_bf16():
        # a CPU without AVX-512's bfloat16 (this round's AVX2 EPYC): oneDNN has no
        # product for it and raises; F.linear stands in, and is timed as itself
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@cache
def _onednn_bf16() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


FORMS: dict[str, Form] = {
    "linear": F.linear,
    "weight @ x.T": _weight_x_t,
    "weight @ x.T, even rows": _weight_x_t_even,
    "kvgate kernel": cpu_kernels.linear,  # F.linear where the kernel is not built
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
        name = _key_name(key)
        if _saved().get(name) in FORMS:
            _chosen[key] = _saved()[name]
        else:
            times = time_forms(weight, rows)
            _chosen[key] = min(times, key=times.__getitem__)
            _save(name, _chosen[key])
    return _chosen[key]


def _key_name(key: tuple[torch.dtype, int, int, int]) -> str:
    dtype, out_features, in_features, rows = key
    return f"{str(dtype).removeprefix('torch.')} {out_features}x{in_features} {rows}"


def choices_path() -> str:
    """This machine's file of choices: a CPU, a torch build or a set of forms of its own."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((line for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    tag = hashlib.sha256(f"{cpu}|{torch.__version__}|{sorted(FORMS)}".encode()).hexdigest()
    return os.path.join(cache_root(), "cpu_rows", f"{tag[:16]}.json")


@cache
def _saved() -> dict[str, str]:
    """The machine's choices as this process last read them."""
    try:
        path = choices_path()
        if os.path.getsize(path) > CHOICES_FILE_BYTES:
            return {}
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):  # none yet, or unreadable: measured, and written anew
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _save(name: str, form: str) -> None:
    """Adds a choice to the machine's file, read again first: written whole under a
    temporary name and renamed, so a reader sees the old file or the new; of two
    processes saving at once one's new key may be lost, and is measured again later."""
    _saved.cache_clear()
    data = {**_saved(), name: form}
    path = choices_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".partial")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, sort_keys=True)
        os.replace(partial, path)
    except OSError:  # a read-only cache: this process keeps its choice, the next measures
        pass


def time_forms(weight: torch.Tensor, rows: int, repeats: int = REPEATS) -> dict[str, float]:
    """Each form's least CPU seconds (this thread's: a loaded machine's waits left out)
    for `rows` rows by a weight of `weight`'s shape read from memory: `weight` itself
    where it outsizes STREAM_BYTES (or is under IN_PLACE_BYTES), else that many bytes
    of copies of its shape, one per product in turn. The forms take turns, so a change
    of load hits them alike."""
    size = weight.numel() * weight.element_size()
    if size < IN_PLACE_BYTES:
        weights = weight[None]
    elif size >= STREAM_BYTES:
        slice_rows = max(1, SLICE_BYTES // (weight.shape[1] * weight.element_size()))
        count = max(1, min(STREAM_BYTES // SLICE_BYTES, weight.shape[0] // slice_rows))
        weights = [weight[i * slice_rows : (i + 1) * slice_rows] for i in range(count)]
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
