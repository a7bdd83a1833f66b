"""gpt-oss's experts on the CPU at decode, where each expert gets a few rows: the two
forms of an expert's product, one expert layer of the engine against transformers', and
an MXFP4 expert's widening against the product it feeds (layers/gpt_oss_moe.py).

    python -m studies.gpt_oss_short_runs [--out OUTDIR]

In one torch thread, the arms of each part interleaved round by round so a loaded
machine's noise hits them alike; each figure is the median of --rounds, in CPU seconds
of the thread (time.thread_time: what the arm ran, not the time other processes took
the core from it):
- products: 16 experts' gate/up (1024 x 512) and down (512 x 512) at 1, 2, 3, 4, 6, 8
  and 16 rows an expert, rows @ weight.T (the engine's in issue 47.4) against
  (weight @ rows.T).T (the weight the GEMM's left operand; the engine's from issue 47.5,
  written straight into a transposed buffer), in float32 and in bfloat16. These 16
  experts' 48 MiB mostly stay in the CPU's 32 MiB L3 round after round, where a decode
  step streams every layer's experts from memory, which reverses the float32 ranking
  (PERF.md "gpt-oss decode: the weights from memory");
- layer: one expert layer of studies.gpt_oss_throughput's model (16 experts of 512, top
  4, hidden 512) at a decode step of 16 tokens, float32: the engine's `per_expert`
  against transformers' GptOssExperts (its model's own experts implementation) on the
  same weights; outputs compared;
- widen: one MXFP4 expert's gate/up (1024 x 512) widened to float32
  (quantization/mxfp4.dequantize) against its product at 4 rows.
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
from backend_gpu.layers.gpt_oss_moe import BiasedExperts, ClampedSwiGLU, per_expert
from backend_gpu.quantization import mxfp4
from bench.options import DefaultsHelpFormatter
from studies.harness import device_environment

EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 16, 512, 512, 4, 16
ROWS = (1, 2, 3, 4, 6, 8, 16)


def interleaved(arms: dict, rounds: int) -> dict[str, float]:
    """Median CPU seconds of each arm's call, the arms taking turns each round."""
    for call in arms.values():
        call()  # once untimed
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, call in arms.items():
            start = time.thread_time()
            call()
            times[name].append(time.thread_time() - start)
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
            ratio = s["(weight @ rows.T).T"] / s["rows @ weight.T"]
            print(
                f"{name} {n}x{k} {kind}, {rows} rows an expert: rows @ weight.T {ratio:.2f}x "
                "the speed of (weight @ rows.T).T",
                flush=True,
            )
    return out


def layer(rounds: int) -> dict:
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    config = GptOssConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=1,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        vocab_size=256,
    )
    theirs = AutoModelForCausalLM.from_config(config, dtype=torch.float32).model.layers[0]
    theirs = theirs.mlp.experts.eval()
    shard = ExpertShard(EXPERTS, 0, EXPERTS, 0, INTER, False)
    ours = BiasedExperts(
        HIDDEN, shard, ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit), True
    )
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.05)
    # transformers' experts are [E, inputs, outputs], the engine's [E, outputs, inputs]
    ours.gate_up_proj.copy_(theirs.gate_up_proj.transpose(1, 2))
    ours.down_proj.copy_(theirs.down_proj.transpose(1, 2))
    ours.gate_up_proj_bias.copy_(theirs.gate_up_proj_bias)
    ours.down_proj_bias.copy_(theirs.down_proj_bias)
    x = torch.randn(TOKENS, HIDDEN)
    ids = torch.rand(TOKENS, EXPERTS).topk(TOP_K, dim=-1).indices
    weights = torch.rand(TOKENS, TOP_K).softmax(-1)
    arms = {
        "transformers": lambda: theirs(x, ids, weights),
        "kvgate": lambda: per_expert(ours, x, weights, ids),
    }
    diff = (arms["transformers"]() - arms["kvgate"]()).abs().max().item()
    s = interleaved(arms, rounds)
    runs = torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()
    implementation = theirs.config._experts_implementation
    print(
        f"one layer, {TOKENS} tokens (runs {runs}): transformers ({implementation}) "
        f"{s['transformers'] * 1e3:.2f} ms, kvgate {s['kvgate'] * 1e3:.2f} ms: "
        f"{s['transformers'] / s['kvgate']:.2f}x; outputs differ by {diff:.1e}"
    )
    return {
        "runs": runs,
        "seconds": s,
        "transformers_experts_implementation": implementation,
        "max_difference": diff,
    }


def widen(rounds: int) -> dict:
    """One MXFP4 gate/up matrix widened to float32 against its product at 4 rows."""
    gen = torch.Generator().manual_seed(0)
    blocks_shape, scales_shape = mxfp4.packed_shapes(1, 2 * INTER, HIDDEN)
    blocks = torch.randint(0, 256, blocks_shape[1:], dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 122, scales_shape[1:], dtype=torch.uint8, generator=gen)
    weight = mxfp4.dequantize(blocks, scales, torch.float32)
    rows = torch.randn(4, HIDDEN, generator=gen)
    s = interleaved(
        {
            "widen": lambda: mxfp4.dequantize(blocks, scales, torch.float32),
            "product": lambda: rows @ weight.t(),
        },
        rounds,
    )
    print(
        f"an MXFP4 gate/up {2 * INTER}x{HIDDEN} widened in {s['widen'] * 1e3:.3f} ms, "
        f"its product at 4 rows {s['product'] * 1e3:.3f} ms"
    )
    return {"seconds": s}


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
        result = {"products": forms, "layer": layer(args.rounds), "widen": widen(args.rounds)}
    result = {"env": device_environment("cpu"), "args": vars(args)} | result
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpt_oss_short_runs.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
