"""Mixture of experts in time: the experts sorted by expert (one matmul per expert, or
one bmm; the Triton grouped GEMM on CUDA) against transformers' loop over experts, and
a MoE model against a dense one with the same active parameters.

    python -m studies.moe_throughput --out OUTDIR                  # the CPU, the engine
    python -m studies.moe_throughput --out OUTDIR --device cuda    # the GPU, one layer

CPU (`--device cpu`): a Mixtral-shaped model with random weights (load_format "dummy";
hidden 512, 4 layers, 8 experts of 1024, top 2) and the Llama whose MLP (2048) has the
same active parameters; 16 concurrent requests of 16 prompt tokens and --tokens output
tokens each through the engine: output tokens/s of the dense model, the MoE model
grouped, and the MoE model with each layer's experts run as transformers' loop. Then
one MoE layer alone on 16 tokens (a decode step), grouped against the loop. Rounds
interleave the arms, so a shared machine's noise hits each alike; the best round counts.
One torch thread by default (--threads).

CUDA (`--device cuda`, studies/gpu_check.sh): one MoE layer of Mixtral 8x7B's shape
(hidden 4096, 8 experts of 14336, top 2, bfloat16: 2.8 GB of experts) at 16, 256 and
2048 tokens: the Triton grouped GEMM against the loop, each output first checked
against the torch grouped path. Each figure is the median over --repeats of --iters.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
from functools import partial
from pathlib import Path

import torch

from backend_gpu.distributed import ParallelGroup
from backend_gpu.expert_shards import ExpertShard, MoEConfig
from backend_gpu.layers.moe import (
    FusedExperts,
    TopKRouter,
    grouped_experts,
    local_expert_ids,
    loop_over_experts,
)
from bench.ladder import Workload, run_workload
from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama
from studies.harness import device_environment
from studies.lora_kernels import median_seconds

BATCH = 16
PROMPT_TOKENS = 16
VOCAB = 4096
BASE = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8}
MOE = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 1024}
DENSE_INTER = MOE["num_experts_per_tok"] * MOE["intermediate_size"]  # the same active MLP
# (hidden, experts, inter, top k, dtype) of one layer on CUDA: Mixtral 8x7B's
CUDA_LAYER = (4096, 8, 14336, 2, torch.bfloat16)
CUDA_TOKENS = (16, 256, 2048)


def write_models(directory: Path) -> dict[str, str]:
    """The dense and the MoE model's directories (config and tokenizer; random weights)."""
    paths = {}
    for name, fields in (
        ("dense", BASE | {"intermediate_size": DENSE_INTER, "num_key_value_heads": 4}),
        (
            "moe",
            BASE
            | MOE
            | {
                "num_key_value_heads": 4,
                "model_type": "mixtral",
                "architectures": ["MixtralForCausalLM"],
            },
        ),
    ):
        path = build_tiny_llama(directory / name, hidden_size=64, num_layers=1, vocab_size=VOCAB)
        config = json.loads((path / "config.json").read_text()) | fields
        (path / "config.json").write_text(json.dumps(config))
        paths[name] = str(path)
    return paths


def engine_rate(model: str, tokens: int, loop: bool) -> float:
    """Output tokens/s of BATCH concurrent requests; `loop`: experts as transformers' loop."""
    from backend_gpu import LLM

    llm = LLM(model, load_format="dummy", max_num_seqs=BATCH, enable_prefix_caching=False)
    if loop:
        for module in llm.engine.runner.model.modules():
            if isinstance(module, FusedExperts):
                module.forward = partial(loop_over_experts, module)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(BATCH)]
    rate = run_workload(llm, Workload("moe", prompts, [tokens] * BATCH), False)["output_tok_s"]
    del llm
    gc.collect()
    return rate


def one_layer(hidden: int, experts: int, inter: int, top_k: int, dtype, device: str):
    """A router and experts with random weights, on `device`."""
    moe = MoEConfig(experts, top_k, inter, True, ("w1", "w3", "w2"), frozenset({0}))
    with torch.device(device):
        router = TopKRouter(hidden, experts, top_k, True).to(dtype)
        shard = ExpertShard.of(moe, ParallelGroup(), False)
        layer = FusedExperts(hidden, shard, moe.leaves).to(dtype)
    with torch.no_grad():
        for param in [*router.parameters(), *layer.parameters()]:
            param.normal_(0.0, param.shape[-1] ** -0.5)
    return router, layer


def layer_seconds(router, layer, tokens: int, device: str, iters: int, repeats: int) -> dict:
    x = torch.randn(tokens, layer.gate_up_proj.shape[-1], device=device).to(
        layer.gate_up_proj.dtype
    )
    weights, ids = router(x)
    paths = {"grouped": layer, "loop": partial(loop_over_experts, layer)}
    got = layer(x, weights, ids)
    want = grouped_experts(layer, x, weights, ids)
    ok = torch.allclose(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    seconds = {
        name: median_seconds(lambda f=fn: f(x, weights, ids), device, iters, repeats)
        for name, fn in paths.items()
    }
    experts_hit = len(local_expert_ids(layer, ids).unique())
    return {"tokens": tokens, "experts_hit": experts_hit, "matches_torch": ok, "seconds": seconds}


def cpu_study(args) -> dict:
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = write_models(Path(tmp))
        for r in range(args.rounds):
            rates = {
                "dense": engine_rate(models["dense"], args.tokens, False),
                "moe_grouped": engine_rate(models["moe"], args.tokens, False),
                "moe_loop": engine_rate(models["moe"], args.tokens, True),
            }
            rounds.append(rates)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in rates.items()))
    best = {name: max(r[name] for r in rounds) for name in rounds[0]}
    router, layer = one_layer(
        BASE["hidden_size"],
        MOE["num_local_experts"],
        MOE["intermediate_size"],
        2,
        torch.float32,
        "cpu",
    )
    layer_run = layer_seconds(router, layer, BATCH, "cpu", args.iters, args.repeats)
    return {"rounds": rounds, "best": best, "layer": layer_run}


def cuda_study(args) -> dict:
    hidden, experts, inter, top_k, dtype = CUDA_LAYER
    router, layer = one_layer(hidden, experts, inter, top_k, dtype, args.device)
    runs = []
    for tokens in CUDA_TOKENS:
        runs.append(layer_seconds(router, layer, tokens, args.device, args.iters, args.repeats))
        s = runs[-1]["seconds"]
        print(
            f"{tokens} tokens: grouped {s['grouped'] * 1e6:.0f} µs, loop {s['loop'] * 1e6:.0f} µs"
        )
    shape = dict(hidden=hidden, experts=experts, inter=inter, top_k=top_k, dtype=str(dtype))
    return {"layer": shape, "runs": runs}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = result["best"]
    names = ["dense (same active)", "MoE, grouped", "MoE, loop over experts"]
    values = [best["dense"], best["moe_grouped"], best["moe_loop"]]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.barh(names[::-1], values[::-1], color=["#bbb", "#59c", "#888"][::-1])
    for i, v in enumerate(values[::-1]):
        ax.text(v, i, f" {v:.0f}", va="center")
    ax.set_xlabel("output tokens/s, 16 concurrent requests (CPU)")
    ax.set_title("8 experts, top 2, vs dense of the same active size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for moe_throughput.json")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=3, help="CPU: engine rounds")
    p.add_argument("--tokens", type=int, default=64, help="CPU: output tokens per request")
    p.add_argument("--iters", type=int, default=20, help="layer calls per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--plot", help="CPU: write the bar chart to this PNG")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU: torch threads (one: OpenMP barriers "
        "on a shared machine's busy cores stall every matmul)",
    )
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    study = cpu_study(args) if args.device == "cpu" else cuda_study(args)
    result = {"env": device_environment(args.device), "args": vars(args)} | study
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_throughput.json").write_text(json.dumps(result, indent=2))
    if args.device == "cpu":
        best, base = result["best"], result["best"]["moe_loop"]
        print("\n| arm | output tok/s (best round) | vs MoE loop |\n|---|---:|---:|")
        for name, rate in best.items():
            print(f"| {name} | {rate:.1f} | {rate / base:.2f}x |")
        s = result["layer"]["seconds"]
        print(
            f"\none layer, {BATCH} tokens: grouped {s['grouped'] * 1e6:.0f} µs, "
            f"loop {s['loop'] * 1e6:.0f} µs ({s['loop'] / s['grouped']:.2f}x)"
        )
        if args.plot:
            plot(result, Path(args.plot))
    return result


if __name__ == "__main__":
    main()
