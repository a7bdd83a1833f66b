"""Which CPU path an INT4 linear layer takes (issue 35): torch's packed INT4 matmul
(aten._weight_int4pack_mm_for_cpu) against dequantizing the layer's weight then one
matmul, per activation dtype and row count, with the dense matmul beside them.

    python -m studies.int4_cpu_matmul [--reps 15]

Shapes: Gemma 3 270M's gate/up (640 -> 4096) and down (2048 -> 640), and Llama 3.2
1B's up (2048 -> 8192); INT4 in groups of 128 with zero points. Each figure is the
fastest of --reps calls after a warm-up (fewer where calls take seconds): on a shared
machine the least disturbed call is the one that says what the code costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F

from backend_gpu.layers.packed_weight_linear import CpuInt4
from backend_gpu.quantization.packed import PackedWeight, dequantize, pack_rows

SHAPES = [(640, 4096), (2048, 640), (2048, 8192)]
ROWS = (1, 16, 256)


def fastest_ms(fn, reps: int, budget_s: float = 3.0) -> float:
    """The fastest of `reps` calls after a warm-up, or of those that fit in `budget_s`
    (at least two): a path that takes seconds a call has said enough by then."""
    fn()
    times: list[float] = []
    while len(times) < reps and (len(times) < 2 or sum(times) < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def random_weight(k: int, n: int, group: int = 128) -> PackedWeight:
    q = torch.randint(0, 16, (k, n), dtype=torch.int32)
    scales = (torch.rand(k // group, n) * 0.01).half()
    zeros = torch.randint(0, 16, (k // group, n)).to(torch.uint8)
    return PackedWeight(pack_rows(q, 4), scales, zeros, None, 4, group, k, n)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("K     N     dtype     rows  int4pack ms  dequant+mm ms  dense ms")
    for k, n in SHAPES:
        w = random_weight(k, n)
        for dtype in (torch.float32, torch.bfloat16):
            # the layer takes the kernel for 16-bit activations only; here in both dtypes
            cpu = CpuInt4.of(w, torch.bfloat16)
            cpu = dataclasses.replace(cpu, scales_and_zeros=cpu.scales_and_zeros.to(dtype))
            dense = dequantize(w, dtype)
            for rows in ROWS:
                x = torch.randn(rows, k).to(dtype)
                a = fastest_ms(lambda x=x, cpu=cpu: cpu.matmul(x), args.reps)
                b = fastest_ms(lambda x=x, w=w: F.linear(x, dequantize(w, x.dtype)), args.reps)
                c = fastest_ms(lambda x=x, dense=dense: F.linear(x, dense), args.reps)
                name = str(dtype).removeprefix("torch.")
                print(f"{k:<5} {n:<5} {name:<9} {rows:>4}  {a:11.2f}  {b:13.2f}  {c:8.2f}")


if __name__ == "__main__":
    main()
