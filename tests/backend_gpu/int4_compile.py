"""Compile the packed INT4/INT8 matmul (backend_gpu/layers/triton_int4.py) for GPUs that
are not here, as kernel_compile.py does the attention kernels: int4_matmul runs on CPU
tensors with its kernel swapped for a recorder, and each distinct launch becomes a cubin
for each target.

    python -m tests.backend_gpu.int4_compile   # one JSON line per compiled kernel

Run with TRITON_INTERPRET unset: under the interpreter `triton.jit` makes no compilable
function.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from backend_gpu.quantization.packed import PackedWeight
from tests.backend_gpu.kernel_compile import print_compiled, record_launches

KERNELS = ("_int_matmul_kernel",)


@dataclass(frozen=True)
class Case:
    """One packed projection of a model (Llama 3 8B's gate_proj: 4096 to 14336) at two
    batch sizes: each case's rows give its own tile shapes, so the four tile shapes (the
    GEMV at 1 and 4 rows, tl.dot at 16 and 64) are compiled once each, not once per case
    (every compile is about a second of CPU)."""

    name: str
    dtype: torch.dtype  # of the activations, the output and the scales
    bits: int
    group_size: int
    rows: tuple[int, int]
    act_order: bool = False
    k: int = 4096
    n: int = 14336

    def weight(self) -> PackedWeight:
        groups = self.k // self.group_size
        g_idx = torch.zeros(self.k, dtype=torch.int32) if self.act_order else None
        return PackedWeight(
            qweight=torch.zeros(self.k * self.bits // 32, self.n, dtype=torch.int32),
            scales=torch.zeros(groups, self.n, dtype=self.dtype),
            zeros=torch.zeros(groups, self.n, dtype=torch.uint8),
            g_idx=g_idx,
            bits=self.bits,
            group_size=self.group_size,
            in_features=self.k,
            out_features=self.n,
        )


CASES = [
    # what llm-compressor's W4A16 publishes: one group's scales per K tile; a decode of
    # one sequence (GEMV) and a prefill chunk
    Case("bfloat16 int4 group 128", torch.bfloat16, 4, 128, rows=(1, 512)),
    # GPTQ act order, 8 bits, float16: each K row gathers its group's scales; a GEMV of
    # four rows and a 16-row decode tile
    Case("float16 int8 act order", torch.float16, 8, 128, rows=(4, 16), act_order=True),
]


def run_wrapper(triton_int4, case: Case) -> None:
    """int4_matmul on CPU tensors of this case, for each of its batch sizes."""
    w = case.weight()
    for rows in case.rows:
        triton_int4.int4_matmul(torch.zeros(rows, case.k, dtype=case.dtype), w)


def main() -> None:
    # here, not at the top: the test imports this module's tables into a process where
    # the kernels must stay interpreted
    from backend_gpu.layers import triton_int4

    print_compiled(record_launches(triton_int4, KERNELS, CASES, run_wrapper))


if __name__ == "__main__":
    sys.exit(main())
