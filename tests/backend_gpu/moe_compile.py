"""Compile the experts' grouped GEMM (backend_gpu/layers/triton_moe.py) for GPUs that are
not here, as kernel_compile.py does the attention kernels: fused_experts runs on CPU
tensors with its kernel swapped for a recorder, and each distinct launch becomes a cubin
for each target.

    python -m tests.backend_gpu.moe_compile   # one JSON line per compiled kernel

Run with TRITON_INTERPRET unset: under the interpreter `triton.jit` makes no compilable
function.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from backend_gpu.quantization.fp8 import FP8
from tests.backend_gpu.kernel_compile import print_compiled, record_launches

KERNELS = ("_grouped_gemm_kernel",)
TOKENS = (1, 512)  # a decode (16-row tiles) and a prefill chunk (64-row tiles)


@dataclass(frozen=True)
class Case:
    """One model's experts on one rank."""

    name: str
    dtype: torch.dtype  # of the activations
    weight_dtype: torch.dtype
    experts: int
    top_k: int
    hidden: int
    inter: int

    def runs_on(self, capability: int) -> bool:
        """FP8 experts only from Ada on: Triton has no E4M3 before it, and the engine
        refuses them there (FusedExperts.quantize)."""
        return self.weight_dtype != FP8 or capability >= 89


CASES = [
    Case("mixtral-8x7b bfloat16", torch.bfloat16, torch.bfloat16, 8, 2, 4096, 14336),
    Case("mixtral-8x7b fp8 experts", torch.bfloat16, FP8, 8, 2, 4096, 14336),
    Case("qwen3-30b-a3b float16", torch.float16, torch.float16, 128, 8, 2048, 768),
]


def run_wrappers(tm, case: Case) -> None:
    """fused_experts on CPU tensors of this case, for each batch size."""
    scaled = case.weight_dtype == FP8
    # empty, not zeros: the wrapper reads only the weights' shapes, dtypes and strides, and
    # Mixtral's are 3.8 GB of float32 that zeros and the cast to 8 or 16 bits would touch
    experts = tm.ExpertWeights(
        torch.empty(case.experts, 2 * case.inter, case.hidden, dtype=case.weight_dtype),
        torch.empty(case.experts, case.hidden, case.inter, dtype=case.weight_dtype),
        torch.ones(case.experts, 2 * case.inter) if scaled else None,
        torch.ones(case.experts, case.hidden) if scaled else None,
    )
    for tokens in TOKENS:
        x = torch.zeros(tokens, case.hidden, dtype=case.dtype)
        local = torch.arange(tokens * case.top_k).view(tokens, case.top_k) % case.experts
        weights = torch.ones(tokens, case.top_k)
        tm.fused_experts(x, experts, weights, local)


def main() -> None:
    # here, not at the top: the test imports this module's tables into a process where
    # the kernels must stay interpreted
    from backend_gpu.layers import triton_moe

    cases = {case.name: case for case in CASES}
    launches = record_launches(triton_moe, KERNELS, CASES, run_wrappers)
    print_compiled(launches, lambda case, capability: cases[case].runs_on(capability))


if __name__ == "__main__":
    sys.exit(main())
