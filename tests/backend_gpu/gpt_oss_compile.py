"""Compile gpt-oss's kernels for GPUs that are not here, as kernel_compile.py does the
attention kernels: the paged attention kernels with sinks at gpt-oss's attention shape
(64 query heads over 8 KV heads of 64, a 128-token window), and the MXFP4 grouped GEMM
(backend_gpu/layers/triton_mxfp4.py) as the experts' kernel path launches it at
gpt-oss's expert sizes (hidden and intermediate 2880, top 4; 8 experts here, which
changes no launch's types or constants) for a decode and a prefill chunk, both matmuls,
in bfloat16 and float16. Each distinct launch becomes a cubin for each target.

    python -m tests.backend_gpu.gpt_oss_compile   # one JSON line per compiled kernel

Run with TRITON_INTERPRET unset: under the interpreter `triton.jit` makes no compilable
function.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from tests.backend_gpu.kernel_compile import (
    KERNELS,
    Shape,
    print_compiled,
    record_launches,
    run_wrappers,
)

ATTENTION = [Shape("gpt-oss attention, sinks", torch.bfloat16, 64, 8, 64, window=128, sinks=True)]
MXFP4_KERNELS = ("_mxfp4_grouped_gemm_kernel",)
TOKENS = (1, 512)  # a decode (16-row tiles) and a prefill chunk (64-row tiles)


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype  # of the activations
    experts: int = 8
    top_k: int = 4
    hidden: int = 2880
    inter: int = 2880


CASES = [
    Case("gpt-oss experts bfloat16", torch.bfloat16),
    Case("gpt-oss experts float16", torch.float16),
]


def run_experts(tm, case: Case) -> None:
    """The experts' kernel path on CPU tensors of this case, for each batch size."""
    from backend_gpu.distributed import ParallelGroup
    from backend_gpu.expert_shards import ExpertShard, MoEConfig
    from backend_gpu.layers.gpt_oss_moe import STACKED, ClampedSwiGLU, Mxfp4Experts, grouped_kernels

    moe = MoEConfig(case.experts, case.top_k, case.inter, True, STACKED, frozenset({0}))
    shard = ExpertShard.of(moe, ParallelGroup(), False)
    experts = Mxfp4Experts(case.hidden, shard, ClampedSwiGLU(1.702, 7.0), down_bias=True)
    for param in experts.parameters():
        param.data = torch.zeros_like(
            param, dtype=case.dtype if param.is_floating_point() else None
        )
    for tokens in TOKENS:
        x = torch.zeros(tokens, case.hidden, dtype=case.dtype)
        ids = torch.arange(tokens * case.top_k).view(tokens, case.top_k) % case.experts
        grouped_kernels(experts, x, torch.ones(tokens, case.top_k), ids)


def main() -> None:
    # here, not at the top: the tests import this module's tables into a process where
    # the kernels must stay interpreted
    from backend_gpu.layers import triton_attention, triton_mxfp4

    print_compiled(record_launches(triton_attention, KERNELS, ATTENTION, run_wrappers))
    print_compiled(record_launches(triton_mxfp4, MXFP4_KERNELS, CASES, run_experts))


if __name__ == "__main__":
    sys.exit(main())
