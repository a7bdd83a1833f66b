"""Compile the LoRA kernels (backend_gpu/layers/triton_lora.py) for GPUs that are not
here, as kernel_compile.py does the attention kernels: the wrappers run on CPU tensors
with their kernels swapped for recorders, and each distinct launch becomes a cubin for
each target.

    python -m tests.backend_gpu.lora_compile   # one JSON line per compiled kernel

Run with TRITON_INTERPRET unset: under the interpreter `triton.jit` makes no compilable
function.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget

from tests.backend_gpu.kernel_compile import TARGETS, Recorder, source

KERNELS = ("_shrink_kernel", "_expand_kernel")
TOKENS = (1, 512)  # a decode (16-row tiles) and a prefill chunk (64-row tiles)


@dataclass(frozen=True)
class Case:
    """Adapters on one projection of a model (Llama 3 8B's gate_proj: 4096 to 14336)."""

    name: str
    dtype: torch.dtype  # of the activations and the output
    adapter_dtype: torch.dtype
    rank: int
    k: int = 4096
    n: int = 14336


CASES = [
    Case("bfloat16 rank 8", torch.bfloat16, torch.bfloat16, 8),
    Case("bfloat16 rank 64", torch.bfloat16, torch.bfloat16, 64),
    Case("bfloat16 rank 128", torch.bfloat16, torch.bfloat16, 128),
    Case("float16 rank 16", torch.float16, torch.float16, 16),
    Case("float32 rank 128", torch.float32, torch.float32, 128),
    Case("bfloat16 with float32 adapters", torch.bfloat16, torch.float32, 64),
]


def run_wrappers(tl_lora, case: Case) -> None:
    """Shrink and expand on CPU tensors of this case, for each batch size."""
    slots = 2
    a = torch.zeros(slots, case.rank, case.k, dtype=case.adapter_dtype)
    b = torch.zeros(slots, case.n, case.rank, dtype=case.adapter_dtype)
    scale = torch.ones(slots)
    for tokens in TOKENS:
        idx = torch.zeros(tokens, dtype=torch.int32)
        x = torch.zeros(tokens, case.k, dtype=case.dtype)
        t = tl_lora.lora_shrink(x, a, idx)
        y = torch.zeros(tokens, 2 * case.n, dtype=case.dtype)[:, case.n :]
        tl_lora.lora_expand(y, t, b, idx, scale)


def launches() -> dict[tuple[str, str, str], tuple[triton.JITFunction, tuple, dict]]:
    """Every distinct launch the wrappers make over CASES, by (case, kernel, variant)."""
    # here, not at the top: the test imports this module's tables into a process where
    # the kernels must stay interpreted
    from backend_gpu.layers import triton_lora

    recorders = {name: Recorder(getattr(triton_lora, name)) for name in KERNELS}
    found = {}
    for case in CASES:
        for name, recorder in recorders.items():
            setattr(triton_lora, name, recorder)
        try:
            run_wrappers(triton_lora, case)
        finally:
            for name, recorder in recorders.items():
                setattr(triton_lora, name, recorder.kernel)
        for name, recorder in recorders.items():
            for args, constexprs in recorder.launches:
                types = tuple(str(a.dtype) if isinstance(a, torch.Tensor) else "int" for a in args)
                key = (case.name, name, f"{types} {sorted(constexprs.items())}")
                found.setdefault(key, (recorder.kernel, args, constexprs))
            recorder.launches.clear()
    return found


def main() -> None:
    for (case, name, variant), (kernel, args, constexprs) in launches().items():
        for target, (capability, shared_limit) in TARGETS.items():
            row = {"shape": case, "kernel": name, "variant": variant, "target": target}
            row["shared_limit"] = shared_limit
            try:
                compiled = triton.compile(
                    source(kernel, args, constexprs), target=GPUTarget("cuda", capability, 32)
                )
            except Exception as e:  # reported, not raised: every failure shows at once
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            else:
                row["shared"] = compiled.metadata.shared
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
