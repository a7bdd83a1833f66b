"""The engine's CPU kernel (layers/cpu_kernels.py) against the library forms it replaces,
at a gpt-oss decode step's sizes (studies.gpt_oss_throughput's model).

    python -m studies.cpu_kernels [--out OUTDIR] [--rounds N]

One torch thread, CPU seconds of the thread (time.thread_time), the arms of each part
taking turns round by round so that a loaded machine's noise hits them alike; each
figure is the least and the median over --rounds:
- experts: 4 layers of 16 experts (gate/up 1024 x 512, down 512 x 512, float32: 192 MiB,
  past the last-level cache, so read from memory as a step reads them) at R rows an
  expert: the kernel over the blocked weights, the kernel over MXFP4 weights, MKL
  (`weight @ run.T` per expert, the engine's form before oneDNN), oneDNN over packed
  weights (`_linear_pointwise` per expert, runs under 6 rows computed as 6: the engine's
  form before the kernel), and summing 192 MiB (the memory's rate: what no product of
  these weights can beat);
- attention: a decode group of 16 sequences of 96 tokens, gpt-oss's heads (8 query over
  2 KV heads of 64) with sinks and a 128-token window, 4 layers: the kernel reading the
  paged cache against the torch path (gather, pad, batched matmuls).
OUTDIR/cpu_kernels.json holds the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from backend_gpu.layers import attention, cpu_kernels, cpu_packed
from backend_gpu.layers.attention import AttentionMetadata, DecodeGroup
from bench.options import DefaultsHelpFormatter
from studies.harness import device_environment

LAYERS, EXPERTS, HIDDEN, INTER = 4, 16, 512, 512
ROWS = (1, 2, 4, 6, 8, 16, 32, 128)
SEQS, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK, WINDOW = 16, 96, 8, 2, 64, 16, 128


def timed(arms: dict, rounds: int) -> dict[str, dict[str, float]]:
    """Each arm's least and median thread-CPU ms, the arms taking turns each round."""
    for call in arms.values():
        call()  # once untimed: oneDNN builds its kernel, the library loads
    spent: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, call in arms.items():
            start = time.thread_time()
            call()
            spent[name].append((time.thread_time() - start) * 1e3)
    return {
        name: {"least_ms": round(min(t), 2), "median_ms": round(statistics.median(t), 2)}
        for name, t in spent.items()
    }


def expert_arms(x: torch.Tensor, per: int, weights: tuple) -> dict:
    """The forms' calls over every layer's weights at `per` rows an expert."""
    stacked, biases, blocked, packed, mx = weights
    runs = [per] * EXPERTS

    def kernel() -> None:
        for w, b in zip(blocked, biases, strict=True):
            cpu_kernels.expert_runs(x, runs, w, b)

    def kernel_mxfp4() -> None:
        for (blocks, scales), b in zip(mx, biases, strict=True):
            cpu_kernels.mxfp4_runs(x, runs, blocks, scales, b)

    def mkl() -> None:
        for w, b in zip(stacked, biases, strict=True):
            for e in range(EXPERTS):
                torch.addmm(b[e, :, None], w[e], x[e * per : (e + 1) * per].t())

    def onednn() -> None:
        for w, b in zip(packed, biases, strict=True):
            cpu_packed.packed_runs(w, b, x, runs)

    return {"kernel": kernel, "kernel, MXFP4": kernel_mxfp4, "MKL": mkl, "oneDNN": onednn}


def difference(x: torch.Tensor, per: int, weights: tuple) -> float:
    """The kernel's largest difference from MKL's product, over the first layer's gate/up."""
    stacked, biases, blocked, _, _ = weights
    got = cpu_kernels.expert_runs(x, [per] * EXPERTS, blocked[0], biases[0])
    want = torch.cat(
        [
            torch.addmm(biases[0][e], x[e * per : (e + 1) * per], stacked[0][e].t())
            for e in range(EXPERTS)
        ]
    )
    return (got - want).abs().max().item()


def experts_part(rounds: int, rows: tuple[int, ...]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2 * INTER, HIDDEN), (HIDDEN, INTER)]  # gate/up, down
    stacked = [
        torch.randn(EXPERTS, *s, generator=gen) * 0.05 for _ in range(LAYERS) for s in shapes
    ]
    biases = [torch.randn(EXPERTS, s[0], generator=gen) for s in shapes] * LAYERS
    blocked = [cpu_kernels.blocked(w) for w in stacked]
    packed = [cpu_packed.pack(w) for w in stacked]
    mx = [
        (
            torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), dtype=torch.uint8),
            torch.randint(118, 122, (EXPERTS, rows, cols // 32), dtype=torch.uint8),
        )
        for rows, cols in shapes * LAYERS
    ]
    memory = torch.ones(sum(w.numel() for w in stacked))
    results = []
    for per in rows:
        x = torch.randn(per * EXPERTS, HIDDEN, generator=gen)
        weights = (stacked, biases, blocked, packed, mx)
        arms = expert_arms(x, per, weights)
        arms["sum of the weights' bytes"] = memory.sum
        figures = timed(arms, rounds)
        results.append(
            {"rows_an_expert": per, "max_difference": difference(x, per, weights), **figures}
        )
        print(
            f"experts, {per} rows an expert: "
            + ", ".join(
                f"{name} {f['least_ms']:.1f}/{f['median_ms']:.1f}" for name, f in figures.items()
            ),
            flush=True,
        )
    return results


def attention_part(rounds: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    blocks_a_seq = -(-CONTEXT // BLOCK)
    slots = SEQS * blocks_a_seq * BLOCK
    caches = [(torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen),) * 2 for _ in range(LAYERS)]
    q = torch.randn(SEQS, HEADS, HEAD_DIM, generator=gen)
    sinks = torch.randn(HEADS, generator=gen)
    tables = torch.randperm(SEQS * blocks_a_seq, generator=gen)
    k_ws, v_ws = (torch.empty(slots * KV_HEADS * HEAD_DIM) for _ in range(2))
    group = DecodeGroup(torch.arange(SEQS), tables, torch.full((SEQS,), CONTEXT), CONTEXT)

    fresh = torch.empty(0, KV_HEADS, HEAD_DIM)  # nothing new written: the step's reads

    def run(kernel: bool):
        def call() -> None:
            meta = AttentionMetadata(torch.empty(0, dtype=torch.long), BLOCK, k_ws, v_ws, [group])
            for k_cache, v_cache in caches:
                attention.paged_attention(
                    q, fresh, fresh, k_cache, v_cache, meta, HEAD_DIM**-0.5, WINDOW, sinks=sinks
                )

        if kernel:
            return call

        def torch_path() -> None:  # the kernel declines: the torch path serves
            real = cpu_kernels.decode_attention
            cpu_kernels.decode_attention = lambda *args: False
            try:
                call()
            finally:
                cpu_kernels.decode_attention = real

        return torch_path

    figures = timed({"kernel": run(True), "torch": run(False)}, rounds)
    print(
        "attention, a 16-sequence decode group, 4 layers: "
        + ", ".join(
            f"{name} {f['least_ms']:.2f}/{f['median_ms']:.2f}" for name, f in figures.items()
        ),
        flush=True,
    )
    return figures


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", help="directory for cpu_kernels.json")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="rows an expert")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if cpu_kernels.library() is None:
        raise SystemExit("the engine's CPU kernel could not be built here (cpu_kernels.py)")
    result = {
        "environment": device_environment("cpu"),
        "rounds": args.rounds,
        "experts": experts_part(args.rounds, tuple(args.rows)),
        "attention": attention_part(args.rounds),
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu_kernels.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
