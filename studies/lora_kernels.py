"""The batched LoRA kernels (backend_gpu/layers/triton_lora.py) in time: one projection
of a mixed-adapter batch, three ways.

    python -m studies.lora_kernels --out OUTDIR [--shape llama3-8b]

- base: the base layer's matmul alone, y = x @ W^T;
- base_kernels: the same plus every token's own adapter through lora_shrink and
  lora_expand (the adapters' grouping of tokens made inside each call, as a caller that
  passes no groups gets);
- base_torch_loop: the same plus the adapters one at a time in torch (the tokens of
  each gathered, two matmuls, added back), the loop a grouped torch path makes;

and the two kernels alone. studies/gpu_check.sh runs it on the GPU. The projection is
Llama 3 8B's gate_proj (4096 to 14336, bfloat16) under 8 adapters of rank 16 spread
evenly and unsorted over the tokens, at a decode batch, a mixed step and a prefill
chunk. Before the timing each batch's kernel output is checked against the reference.
Each figure is the median over --repeats of --iters calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from backend_gpu.layers.triton_lora import lora_expand, lora_expand_ref, lora_shrink
from bench.options import DefaultsHelpFormatter
from studies.harness import device_environment


@dataclass(frozen=True)
class Shape:
    k: int  # the projection's input size
    n: int  # its output size
    adapters: int
    rank: int
    tokens: tuple[int, ...]  # the batches timed
    dtype: torch.dtype


# "tiny" runs in Triton's interpreter on a CPU in seconds (a smoke test)
SHAPES = {
    "llama3-8b": Shape(4096, 14336, 8, 16, (16, 256, 2048), torch.bfloat16),
    "tiny": Shape(32, 48, 4, 8, (3, 20), torch.float32),
}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], device: str, iters: int, repeats: int) -> float:
    """Median over repeats of one call's mean time over iters calls."""
    fn()  # once untimed: compilation and first-call costs out of the figures
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def measure(shape: Shape, tokens: int, device: str, iters: int, repeats: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(tokens)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).to(shape.dtype)

    x, w = randn(tokens, shape.k), randn(shape.n, shape.k, scale=shape.k**-0.5)
    a = randn(shape.adapters, shape.rank, shape.k, scale=shape.k**-0.5)
    b = randn(shape.adapters, shape.n, shape.rank, scale=shape.rank**-0.5)
    scale = torch.full((shape.adapters,), 2.0, device=device)
    order = torch.randperm(tokens, generator=gen, device=device)
    idx = (order % shape.adapters).to(torch.int32)
    rows = [torch.nonzero(idx == s).flatten() for s in range(shape.adapters)]
    factors = scale.tolist()

    def base() -> torch.Tensor:
        return x @ w.T

    def kernels(y: torch.Tensor) -> torch.Tensor:
        lora_expand(y, lora_shrink(x, a, idx), b, idx, scale)
        return y

    def torch_loop() -> torch.Tensor:
        y = base()
        for s, r in enumerate(rows):
            y.index_add_(0, r, (x[r] @ a[s].T) @ b[s].T * factors[s])
        return y

    want = base()
    lora_expand_ref(want, lora_shrink(x, a, idx), b, idx, scale)
    got = kernels(base())
    tol = TOLERANCE[shape.dtype]
    matches = torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    y = base()
    runs = {
        "base": base,
        "base_kernels": lambda: kernels(base()),
        "base_torch_loop": torch_loop,
        "kernels": lambda: kernels(y),
    }
    seconds = {name: median_seconds(fn, device, iters, repeats) for name, fn in runs.items()}
    return {
        "tokens": tokens,
        "matches_reference": matches,
        "seconds": seconds,
        "kernels_over_base": seconds["base"] / seconds["base_kernels"],
        "torch_loop_over_base": seconds["base"] / seconds["base_torch_loop"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for lora_kernels.json")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=20, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    iters, repeats = (1, 1) if args.device == "cpu" else (args.iters, args.repeats)
    config = asdict(shape) | {"dtype": str(shape.dtype), "shape": args.shape}
    result: dict = {"env": device_environment(args.device), "config": config, "runs": []}
    for tokens in shape.tokens:
        result["runs"].append(measure(shape, tokens, args.device, iters, repeats))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_kernels.json").write_text(json.dumps(result, indent=2))
    print(f"{args.shape}: {shape.adapters} adapters of rank {shape.rank}, {args.device}")
    print("| tokens | base µs | + kernels µs | + torch loop µs | kernels alone µs | ok |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in result["runs"]:
        us = {name: s * 1e6 for name, s in r["seconds"].items()}
        print(
            f"| {r['tokens']} | {us['base']:.1f} | {us['base_kernels']:.1f} | "
            f"{us['base_torch_loop']:.1f} | {us['kernels']:.1f} | {r['matches_reference']} |"
        )
    return result


if __name__ == "__main__":
    main()
