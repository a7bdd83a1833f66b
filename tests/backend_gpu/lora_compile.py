"""Compile the LoRA kernels (backend_gpu/layers/triton_lora.py) for GPUs that are not
here, as kernel_compile.py does the attention kernels: the wrappers run on CPU tensors
with their kernels swapped for recorders, and each distinct launch becomes a cubin for
each target.

    python -m tests.backend_gpu.lora_compile   # one JSON line per compiled kernel

Run with TRITON_INTERPRET unset: under the interpreter `triton.jit` makes no compilable
function.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from tests.backend_gpu.kernel_compile import print_compiled, record_launches

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


def main() -> None:
    # here, not at the top: the test imports this module's tables into a process where
    # the kernels must stay interpreted
    from backend_gpu.layers import triton_lora

    print_compiled(record_launches(triton_lora, KERNELS, CASES, run_wrappers))


if __name__ == "__main__":
    sys.exit(main())
