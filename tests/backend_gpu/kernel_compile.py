"""Compile the paged attention kernels for a GPU that is not here: Triton builds a cubin
for a named target (LLVM and ptxas in-process, no driver), which catches what its
interpreter on the CPU never sees: type errors, shapes a tensor-core dot refuses, FP8
conversions, a kernel needing more shared memory than the GPU has.

    python -m tests.backend_gpu.kernel_compile   # one JSON line per compiled kernel

The launches are the wrappers' own: the kernels are swapped for recorders and the
wrappers run on CPU tensors shaped like each model below, so what is compiled is what the
engine would launch (signature, constexprs), not a copy of it. Run with
TRITON_INTERPRET unset: under the interpreter `triton.jit` makes no compilable function.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from backend_gpu.quantization.fp8 import FP8

KERNELS = ("_decode_split_kernel", "_decode_merge_kernel", "_prefill_kernel")
# (compute capability, shared memory a block may use in bytes)
TARGETS = {
    "sm_90 (H100, H200)": (90, 232_448),
    "sm_89 (L40S, RTX 4090)": (89, 101_376),
    "sm_80 (A100)": (80, 166_912),
}
TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.uint8: "u8",
    FP8: "fp8e4nv",
}


@dataclass(frozen=True)
class Shape:
    """One model's attention as the engine runs it."""

    name: str
    dtype: torch.dtype
    q_heads: int
    kv_heads: int
    head_dim: int
    fp8_cache: bool = False
    window: int | None = None
    block_size: int = 16
    sinks: bool = False  # a logit per query head in the denominator (gpt-oss)

    def runs_on(self, capability: int) -> bool:
        """An FP8 cache only from Ada on: Triton has no E4M3 before it, and the engine
        refuses the cache there (fp8.check_fp8_kv_cache)."""
        return not self.fp8_cache or capability >= 89


SHAPES = [
    Shape("llama-3-8b", torch.bfloat16, 32, 8, 128),
    Shape("llama-3-8b fp8 cache", torch.bfloat16, 32, 8, 128, fp8_cache=True),
    Shape("gemma-3 local layer", torch.bfloat16, 4, 1, 256, window=512),
    Shape("qwen-2.5-7b (group 7)", torch.float16, 28, 4, 128, block_size=32),
    Shape("tiny test model", torch.float32, 4, 2, 16),
]
SPLITS = (1, 16)  # decode shares of a context: the fewest and the most _num_splits picks
QUERY_LENS = (512, 4)  # a prefill chunk; a speculative verification of 3 proposals


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **constexprs)` records the call."""

    def __init__(self, kernel: triton.JITFunction) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def arg_type(arg) -> str:
    if isinstance(arg, torch.Tensor):
        return "*" + TRITON_TYPES[arg.dtype]
    if isinstance(arg, float):
        return "fp32"
    assert isinstance(arg, int), type(arg)
    return "i32" if -(2**31) <= arg < 2**31 else "i64"


def source(kernel: triton.JITFunction, args: tuple, constexprs: dict) -> ASTSource:
    names = kernel.arg_names
    signature = {name: arg_type(arg) for name, arg in zip(names, args, strict=False)}
    signature |= {name: "constexpr" for name in constexprs}
    indexed = {(names.index(name),): value for name, value in constexprs.items()}
    return ASTSource(kernel, signature, constexprs=indexed)


def run_wrappers(ta: ModuleType, shape: Shape) -> None:
    """The decode and prefill wrappers on a small CPU batch of this shape."""
    batch, blocks = 2, 4
    cache_dtype = FP8 if shape.fp8_cache else shape.dtype
    cache = torch.zeros(blocks * batch, shape.block_size, shape.kv_heads, shape.head_dim)
    k_cache, v_cache = cache.to(cache_dtype), cache.to(cache_dtype)
    tables = torch.arange(blocks * batch, dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), blocks * shape.block_size, dtype=torch.int32)
    scales = dict(sliding_window=shape.window, k_scale=0.5, v_scale=0.25)
    if shape.sinks:
        scales["sinks"] = torch.zeros(shape.q_heads, dtype=shape.dtype)
    for splits in SPLITS:
        q = torch.zeros(batch, shape.q_heads, shape.head_dim, dtype=shape.dtype)
        ta.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, 0.1, **scales, num_splits=splits
        )
    for query_len in QUERY_LENS:
        q = torch.zeros(batch * query_len, shape.q_heads, shape.head_dim, dtype=shape.dtype)
        starts = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32)
        ta.paged_prefill_attention(
            q, k_cache, v_cache, tables, lens, starts, query_len, 0.1, **scales
        )


Launches = dict[tuple[str, str, str], tuple[triton.JITFunction, tuple, dict]]


def record_launches(
    module: ModuleType, kernels: tuple[str, ...], cases: list, run: Callable
) -> Launches:
    """Every distinct launch `run(module, case)` makes of `module`'s `kernels` over
    `cases` (each with a `name`), by (case, kernel, what varies: argument types and
    constexprs)."""
    recorders = {name: Recorder(getattr(module, name)) for name in kernels}
    found: Launches = {}
    for case in cases:
        for name, recorder in recorders.items():
            setattr(module, name, recorder)
        try:
            run(module, case)
        finally:
            for name, recorder in recorders.items():
                setattr(module, name, recorder.kernel)
        for name, recorder in recorders.items():
            for args, constexprs in recorder.launches:
                types = tuple(arg_type(a) for a in args)
                key = (case.name, name, f"{types} {sorted(constexprs.items())}")
                found.setdefault(key, (recorder.kernel, args, constexprs))
            recorder.launches.clear()
    return found


def print_compiled(launches: Launches, runs_on: Callable[[str, int], bool] = lambda *_: True):
    """Compile each launch for each target it runs on (`runs_on(case, capability)`),
    one JSON line each: its shared memory, or its error (reported, not raised: every
    failure shows at once)."""
    for (case, name, variant), (kernel, args, constexprs) in launches.items():
        for target, (capability, shared_limit) in TARGETS.items():
            if not runs_on(case, capability):
                continue
            row = {"shape": case, "kernel": name, "variant": variant, "target": target}
            row["shared_limit"] = shared_limit
            try:
                compiled = triton.compile(
                    source(kernel, args, constexprs), target=GPUTarget("cuda", capability, 32)
                )
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            else:
                row["shared"] = compiled.metadata.shared
                row["cubin_bytes"] = len(compiled.asm["cubin"])
            print(json.dumps(row), flush=True)


def main() -> None:
    # here, not at the top: the test imports this module's tables into a process where
    # the kernels must stay interpreted
    from backend_gpu.layers import triton_attention

    shapes = {shape.name: shape for shape in SHAPES}
    launches = record_launches(triton_attention, KERNELS, SHAPES, run_wrappers)
    print_compiled(launches, lambda shape, capability: shapes[shape].runs_on(capability))


if __name__ == "__main__":
    sys.exit(main())
