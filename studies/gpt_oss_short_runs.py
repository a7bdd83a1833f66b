"""gpt-oss's experts on the CPU at decode: an expert's short run of rows multiplied as
rows @ weight.T against (weight @ rows.T).T, the weight the GEMM's left operand
(layers/gpt_oss_moe.py's SHORT_RUN).

    python -m studies.gpt_oss_short_runs [--out OUTDIR]

Two parts, in one torch thread, each arm interleaved with the other round by round so a
loaded machine's noise hits both alike; each figure is the median of --rounds:
- products: 16 experts' gate/up (1024 x 512) and down (512 x 512) at 1, 2, 3, 4, 6, 8
  and 16 rows an expert, each form alone, in float32 and in bfloat16;
- layer: one expert layer of studies.gpt_oss_throughput's model (16 experts of 512, top
  4, hidden 512) at a decode step of 16 tokens, `per_expert` with SHORT_RUN 0 (every run
  rows @ weight.T, the engine before) against its SHORT_RUN; outputs compared.
OUTDIR/gpt_oss_short_runs.json holds the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from backend_gpu.expert_shards import ExpertShard
from backend_gpu.layers import gpt_oss_moe
from backend_gpu.layers.gpt_oss_moe import BiasedExperts, ClampedSwiGLU, per_expert
from bench.options import DefaultsHelpFormatter
from studies.harness import device_environment

EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 16, 512, 512, 4, 16
ROWS = (1, 2, 3, 4, 6, 8, 16)


def interleaved(arms: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each arm's call, the arms taking turns each round."""
    for call in arms.values():
        call()  # once untimed
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, call in arms.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def products(rounds: int, dtype: torch.dtype) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for name, (n, k) in {"gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}.items():
        weights = torch.randn(EXPERTS, n, k, generator=gen).to(dtype)
        for rows in ROWS:
            x = torch.randn(EXPERTS, rows, k, generator=gen).to(dtype)
            y = torch.empty(EXPERTS, rows, n, dtype=dtype)

            def packed(weights=weights, x=x, y=y) -> None:
                for e in range(EXPERTS):
                    torch.mm(x[e], weights[e].t(), out=y[e])

            def left(weights=weights, x=x, y=y) -> None:
                for e in range(EXPERTS):
                    y[e] = torch.mm(weights[e], x[e].t()).t()

            s = interleaved({"rows @ weight.T": packed, "(weight @ rows.T).T": left}, rounds)
            kind = str(dtype).removeprefix("torch.")
            out.append({"projection": name, "dtype": kind, "rows": rows, "seconds": s})
            ratio = s["rows @ weight.T"] / s["(weight @ rows.T).T"]
            print(f"{name} {n}x{k} {kind}, {rows} rows an expert: {ratio:.2f}x", flush=True)
    return out


def layer(rounds: int) -> dict:
    torch.manual_seed(0)
    shard = ExpertShard(EXPERTS, 0, EXPERTS, 0, INTER, False)
    experts = BiasedExperts(HIDDEN, shard, ClampedSwiGLU(1.702, 7.0), down_bias=True)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.05)
    x = torch.randn(TOKENS, HIDDEN)
    ids = torch.rand(TOKENS, EXPERTS).topk(TOP_K, dim=-1).indices
    weights = torch.rand(TOKENS, TOP_K).softmax(-1)
    short = gpt_oss_moe.SHORT_RUN

    def run(threshold: int) -> torch.Tensor:
        gpt_oss_moe.SHORT_RUN = threshold
        try:
            return per_expert(experts, x, weights, ids)
        finally:
            gpt_oss_moe.SHORT_RUN = short

    diff = (run(0) - run(short)).abs().max().item()
    s = interleaved({"before": lambda: run(0), "after": lambda: run(short)}, rounds)
    runs = torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()
    print(
        f"one layer, {TOKENS} tokens (runs {runs}): before {s['before'] * 1e3:.2f} ms, "
        f"after {s['after'] * 1e3:.2f} ms: {s['before'] / s['after']:.2f}x; "
        f"outputs differ by {diff:.1e}"
    )
    return {"runs": runs, "seconds": s, "short_run": short, "max_difference": diff}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", default=".", help="directory for gpt_oss_short_runs.json")
    p.add_argument("--rounds", type=int, default=40, help="timed rounds of each arm")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with torch.inference_mode():
        forms = [*products(args.rounds, torch.float32), *products(args.rounds, torch.bfloat16)]
        result = {"products": forms, "layer": layer(args.rounds)}
    result = {"env": device_environment("cpu"), "args": vars(args)} | result
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpt_oss_short_runs.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
