"""Compile the MLA kernel (backend_gpu/layers/triton_mla.py) for GPUs that are not here,
as kernel_compile.py does the attention kernels: mla_paged_attention runs on CPU tensors
with its kernels swapped for recorders, and each distinct launch becomes a cubin for each
target.

    python -m tests.backend_gpu.mla_compile   # one JSON line per compiled kernel

Run with TRITON_INTERPRET unset: under the interpreter `triton.jit` makes no compilable
function.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from backend_gpu.quantization.fp8 import FP8
from tests.backend_gpu.kernel_compile import print_compiled, record_launches

KERNELS = ("_mla_split_kernel", "_decode_merge_kernel")
# (query length, splits): decodes split and whole, a verification of 3 proposals, a
# prefill chunk
LAUNCHES = ((1, 16), (1, 1), (4, 2), (512, 1))


@dataclass(frozen=True)
class Case:
    """One model's MLA on one rank."""

    name: str
    dtype: torch.dtype
    heads: int
    rank: int  # kv_lora_rank
    rope: int  # qk_rope_head_dim
    fp8_cache: bool = False
    block_size: int = 16

    def runs_on(self, capability: int) -> bool:
        """An FP8 cache only from Ada on (fp8.check_fp8_kv_cache)."""
        return not self.fp8_cache or capability >= 89


CASES = [
    Case("deepseek-v3 tp8", torch.bfloat16, 16, 512, 64),
    Case("deepseek-v3 tp1, 64-token blocks", torch.bfloat16, 128, 512, 64, block_size=64),
    Case("deepseek-v3 fp8 cache", torch.bfloat16, 16, 512, 64, fp8_cache=True),
    Case("deepseek-v2-lite float16", torch.float16, 16, 512, 64),
    Case("tiny test model", torch.float32, 4, 32, 16),
]


def run_wrappers(tm, case: Case) -> None:
    """mla_paged_attention on CPU tensors of this case, for each launch shape."""
    batch, blocks, width = 2, 4, case.rank + case.rope
    cache = torch.zeros(batch * blocks, case.block_size, width)
    cache = cache.to(FP8 if case.fp8_cache else case.dtype)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), blocks * case.block_size, dtype=torch.int32)
    for query_len, splits in LAUNCHES:
        q = torch.zeros(batch * query_len, case.heads, width, dtype=case.dtype)
        starts = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32)
        tm.mla_paged_attention(
            q, cache, tables, lens, starts, query_len, 0.1, case.rank, num_splits=splits
        )


def main() -> None:
    # here, not at the top: the test imports this module's tables into a process where
    # the kernels must stay interpreted
    from backend_gpu.layers import triton_mla

    cases = {case.name: case for case in CASES}
    launches = record_launches(triton_mla, KERNELS, CASES, run_wrappers)
    print_compiled(launches, lambda case, capability: cases[case].runs_on(capability))


if __name__ == "__main__":
    sys.exit(main())
