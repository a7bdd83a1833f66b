"""Issue 15's benchmark: `kvgate bench noisy` against one gateway per fairness policy
(`vtc` and `fcfs`, both up at once, the phases alternating between them), on the gpu
engine (bench.tiny_model's random Llama on the CPU, its batch capped at
`--max-num-seqs` so that a flood of 32 overflows it) and on the llama.cpp backend (the
default Gemma 3 270M, 4 parallel sequences), all in one run. Writes a JSON report and a
plot.

    .venv/bin/python -m studies.noisy_neighbour --out docs/perf/noisy_neighbour.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.noisy import add_noisy_args, run_noisy, with_shapes
from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama, parameter_count
from studies.harness import TINY_LLAMA, start_gateway, tenant_key, toml_backend

FAIRNESS = ("vtc", "fcfs")


def backend_config(backend: str, model: str, args: argparse.Namespace) -> str:
    """The gateway's one backend (`--fairness` reaches the gpu engine's scheduler)."""
    if backend == "gpu":
        return toml_backend("tiny", "gpu", "tiny", model, max_num_seqs=args.max_num_seqs)
    return toml_backend("gemma", "local", "gemma", n_parallel=args.n_parallel)


def run_backend(workdir: Path, backend: str, model: str, args: argparse.Namespace) -> dict:
    """Both policies' gateways up at once, the phases alternating between them."""
    with contextlib.ExitStack() as stack:
        targets = {}
        for fairness in FAIRNESS:
            config = backend_config(backend, model, args)
            gw = start_gateway(workdir, f"{backend}-{fairness}", config, "--fairness", fairness)
            stack.enter_context(gw)
            target = argparse.Namespace(**vars(args))
            target.url, target.model = gw.url, "tiny" if backend == "gpu" else "gemma"
            target.key_a = tenant_key(gw.url, "A", weight=1.0)
            target.key_b = tenant_key(gw.url, "B", weight=1.0)
            target.key_heavy = tenant_key(gw.url, "heavy", weight=args.heavy_weight)
            targets[fairness] = with_shapes(target)
        return asyncio.run(run_noisy(targets, lambda m: print(f"{backend} {m}", flush=True)))


def compare(runs: dict) -> dict:
    """The issue's goals, vtc against fcfs from the same run."""
    vtc, fcfs = runs["vtc"], runs["fcfs"]
    return {
        "B_ttft_p99_flood_vs_alone": {p: runs[p]["flood"]["B_ttft_p99_vs_alone"] for p in runs},
        "share_1_1": {p: runs[p]["backlog"]["share_vs_weights"] for p in runs},
        "share_2_1": {p: runs[p]["backlog_weighted"]["share_vs_weights"] for p in runs},
        "throughput_vtc_vs_fcfs": {
            phase: vtc[phase]["output_tokens_per_s"] / fcfs[phase]["output_tokens_per_s"]
            for phase in ("flood", "backlog", "backlog_weighted")
        },
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = [b for b in ("gpu", "local") if b in report["results"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["B alone", "B under flood, vtc", "B under flood, fcfs"]
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = []
        for b in backends:
            runs = report["results"][b]
            if label == "B alone":
                values.append(runs["vtc"]["alone"]["B"]["ttft_p99_ms"])
            else:
                values.append(runs[label.rsplit(", ", 1)[1]]["flood"]["B"]["ttft_p99_ms"])
        axes[0].bar([x + i * width for x in range(len(backends))], values, width, label=label)
    axes[0].set_xticks([x + width for x in range(len(backends))], backends)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("tenant B's TTFT p99 (ms, log)")
    axes[0].legend()
    cases = [(b, w) for b in backends for w in ("backlog", "backlog_weighted")]
    for i, policy in enumerate(FAIRNESS):
        values = [report["results"][b][policy][w]["share_vs_weights"] for b, w in cases]
        axes[1].bar([x + i * 0.4 for x in range(len(cases))], values, 0.4, label=policy)
    names = [f"{b}\n{'1:1' if w == 'backlog' else '2:1'}" for b, w in cases]
    axes[1].set_xticks([x + 0.2 for x in range(len(cases))], names)
    axes[1].axhline(1.0, color="black", linewidth=0.8)
    axes[1].set_ylabel("service share / weight share (1 = fair)")
    axes[1].legend()
    fig.suptitle("A noisy neighbour: tenant A floods, tenant B sends a steady trickle")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m studies.noisy_neighbour",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    add_noisy_args(p)
    p.add_argument("--backends", default="gpu,local", help="comma-separated: gpu, local")
    p.add_argument("--max-num-seqs", type=int, default=8, help="gpu engine batch cap")
    p.add_argument("--n-parallel", type=int, default=4, help="llama.cpp sequences")
    p.add_argument("--out", default="docs/perf/noisy_neighbour.json")
    args = p.parse_args(argv)
    report: dict = {"machine": f"{os.cpu_count()} CPUs", "results": {}}
    with tempfile.TemporaryDirectory(prefix="kvgate-noisy-") as tmp:
        workdir = Path(tmp)
        model = str(build_tiny_llama(workdir / "tiny-llama", **TINY_LLAMA))
        report["tiny_model"] = f"random Llama, {parameter_count(model) / 1e6:.1f}M params"
        for backend in args.backends.split(","):
            runs = run_backend(workdir, backend, model, args)
            report["results"][backend] = runs | {"compare": compare(runs)}
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, Path(args.out).with_suffix(".png"))
    print(json.dumps({b: r["compare"] for b, r in report["results"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
