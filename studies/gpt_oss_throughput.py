"""gpt-oss in bytes and time: its experts in MXFP4 (as published, kept packed) against
bfloat16, and the engine's decode against transformers'.

    python -m studies.gpt_oss_throughput --out OUTDIR                  # the CPU
    python -m studies.gpt_oss_throughput --out OUTDIR --device cuda    # the GPU, one layer

CPU (`--device cpu`): a random gpt-oss of hidden 512, 4 layers (a 128-token window on
every other one), 8 query heads of 64 over 2 KV heads, 16 experts of 512 with top 4 and
a vocabulary of 4096 (57M parameters), written by transformers, and the same model with
its experts quantized to MXFP4 in the published layout (tests/backend_gpu/
mxfp4_checkpoints.py). Bytes: the engine loads each in bfloat16 and the experts'
parameters are counted. Time: 16 concurrent requests of 32 prompt tokens and --tokens
output tokens each, greedy, float32: the engine on the 16-bit and on the MXFP4 checkpoint
(experts widened one at a time on the CPU) against transformers' continuous batching
(what `generate_batch` drives) on the 16-bit one, timed after its set-up as the engine
is after `LLM(...)`. Rounds interleave the arms, so a shared machine's noise hits each
alike; the best round counts. Beside each round's tok/s, the process's CPU time per
output token (time.process_time, transformers' generation thread included): what the
arm itself ran, which a loaded machine moves far less than the wall clock (the least
round counts). One torch thread by default (--threads).

CUDA (`--device cuda`, studies/gpu_check.sh): one layer of gpt-oss-120b's experts (128
of 2880, hidden 2880, top 4) at 16, 256 and 2048 tokens, the experts' kernel path over
MXFP4 weights (layers/triton_mxfp4.py) against the same over bfloat16 weights
(triton_moe.py's grouped GEMM), each output first checked against the torch path. Each
figure is the median over --repeats of --iters.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from bench.ladder import Workload, run_workload
from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama
from studies.harness import device_environment
from studies.lora_kernels import median_seconds
from tests.backend_gpu.mxfp4_checkpoints import write_mxfp4_checkpoint
from tests.backend_gpu.tiny_gpt_oss import randomize_gpt_oss

BATCH = 16
PROMPT_TOKENS = 32
VOCAB = 4096
SHAPE = dict(
    hidden_size=512,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=16,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=4096,
    vocab_size=VOCAB,
)
# (experts, hidden, inter, top k) of one layer on CUDA: gpt-oss-120b's
CUDA_LAYER = (128, 2880, 2880, 4)
CUDA_TOKENS = (16, 256, 2048)


def write_models(directory: Path) -> dict[str, str]:
    """The 16-bit and the MXFP4 checkpoint's directories (with a word-level tokenizer)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    path = build_tiny_llama(directory / "16-bit", hidden_size=64, num_layers=1, vocab_size=VOCAB)
    torch.manual_seed(0)
    config = GptOssConfig(**SHAPE, initializer_range=0.05, architectures=["GptOssForCausalLM"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_gpt_oss(model)
    (path / "model.safetensors").unlink()
    model.save_pretrained(path)
    mxfp4 = write_mxfp4_checkpoint(str(path), str(directory / "mxfp4"))
    return {"16-bit": str(path), "mxfp4": mxfp4}


def workload(tokens: int) -> Workload:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(BATCH)]
    return Workload("gpt-oss", prompts, [tokens] * BATCH)


def engine_rate(model: str, tokens: int) -> tuple[float, float]:
    """(output tok/s, the process's CPU ms per output token)."""
    from backend_gpu import LLM

    llm = LLM(model, max_num_seqs=BATCH, enable_prefix_caching=False)
    cpu = time.process_time()
    result = run_workload(llm, workload(tokens), False)
    cpu_ms = (time.process_time() - cpu) * 1e3 / result["output_tokens"]
    del llm
    gc.collect()
    return result["output_tok_s"], cpu_ms


def transformers_rate(model_dir: str, tokens: int) -> tuple[float, float]:
    """transformers' continuous batching manager (what generate_batch drives), timed
    from the first request added to the last finished: (output tok/s, the process's
    CPU ms per output token, its generation thread's included)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    work = workload(tokens)
    with model.continuous_batching_context_manager(generation_config=config, block=True) as cb:
        start, cpu = time.perf_counter(), time.process_time()
        for prompt, n in zip(work.prompts, work.max_tokens, strict=True):
            cb.add_request(prompt, max_new_tokens=n)
        generated = done = 0
        while done < len(work.prompts):
            result = cb.get_result(timeout=1)
            if result is not None and result.is_finished():
                generated += len(result.generated_tokens)
                done += 1
            elif result is None and not cb.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert generated == sum(work.max_tokens), generated
    del model
    gc.collect()
    return generated / seconds, cpu * 1e3 / generated


def expert_bytes(model: str) -> dict:
    """Bytes the engine holds loading `model` in bfloat16: the experts', everything."""
    from backend_gpu import LLM
    from backend_gpu.layers.cpu_packed import packed_bytes
    from backend_gpu.memory import parameter_bytes

    llm = LLM(model, dtype="bfloat16", kv_cache_memory_bytes=1 << 20, max_model_len=256)
    runner = llm.engine.runner
    experts = sum(
        parameter_bytes(layer.mlp.experts) + packed_bytes(layer.mlp.experts)  # oneDNN's
        for layer in runner.model.model.layers
    )
    sizes = {"experts": experts, "weights": runner.weight_bytes}
    del llm
    gc.collect()
    return sizes


def cpu_study(args) -> dict:
    rounds: list[dict] = []
    cpu_rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = write_models(Path(tmp))
        sizes = {fmt: expert_bytes(path) for fmt, path in models.items()}
        for r in range(args.rounds):
            timed = {
                "kvgate 16-bit": engine_rate(models["16-bit"], args.tokens),
                "kvgate mxfp4": engine_rate(models["mxfp4"], args.tokens),
                "transformers generate_batch": transformers_rate(models["16-bit"], args.tokens),
            }
            rounds.append({name: rate for name, (rate, _) in timed.items()})
            cpu_rounds.append({name: cpu for name, (_, cpu) in timed.items()})
            print(
                f"round {r + 1}: "
                + ", ".join(
                    f"{k} {v:.1f} tok/s ({c:.2f} CPU ms/token)" for k, (v, c) in timed.items()
                )
            )
    best = {name: max(r[name] for r in rounds) for name in rounds[0]}
    least_cpu = {name: min(r[name] for r in cpu_rounds) for name in cpu_rounds[0]}
    return {
        "bytes": sizes,
        "rounds": rounds,
        "best": best,
        "cpu_ms_per_token_rounds": cpu_rounds,
        "least_cpu_ms_per_token": least_cpu,
    }


def cuda_layer(packed: bool):
    """gpt-oss-120b's experts of one layer with random weights, in MXFP4 or bfloat16."""
    from backend_gpu.distributed import ParallelGroup
    from backend_gpu.expert_shards import ExpertShard, MoEConfig
    from backend_gpu.layers.gpt_oss_moe import STACKED, BiasedExperts, ClampedSwiGLU, Mxfp4Experts

    experts, hidden, inter, top_k = CUDA_LAYER
    moe = MoEConfig(experts, top_k, inter, True, STACKED, frozenset({0}))
    shard = ExpertShard.of(moe, ParallelGroup(), False)
    cls = Mxfp4Experts if packed else BiasedExperts
    with torch.device("cuda"):
        layer = cls(hidden, shard, ClampedSwiGLU(1.702, 7.0), down_bias=True)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("_blocks"):
                param.random_(0, 256)
            elif name.endswith("_scales"):
                param.random_(118, 122)
            else:
                param.normal_(0.0, 0.02)
    return layer.to(torch.bfloat16)


def cuda_study(args) -> dict:
    from backend_gpu.layers.gpt_oss_moe import grouped_kernels, per_expert
    from backend_gpu.memory import parameter_bytes

    experts, hidden, _, top_k = CUDA_LAYER
    layers = {"mxfp4": cuda_layer(True), "bfloat16": cuda_layer(False)}
    runs = []
    for tokens in CUDA_TOKENS:
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, device="cuda").softmax(-1)
        run = {"tokens": tokens, "experts_hit": len(ids.unique()), "seconds": {}, "matches": {}}
        for fmt, layer in layers.items():
            got = grouped_kernels(layer, x, weights, ids)
            want = per_expert(layer, x, weights, ids)
            close = torch.allclose(got.float(), want.float(), rtol=3e-2, atol=3e-2)
            run["matches"][fmt] = close
            call = partial(grouped_kernels, layer, x, weights, ids)
            run["seconds"][fmt] = median_seconds(call, "cuda", args.iters, args.repeats)
        s = run["seconds"]
        print(
            f"{tokens} tokens: mxfp4 {s['mxfp4'] * 1e6:.0f} µs, bfloat16 "
            f"{s['bfloat16'] * 1e6:.0f} µs ({s['bfloat16'] / s['mxfp4']:.2f}x), "
            f"outputs match the torch path: {run['matches']}"
        )
        runs.append(run)
    sizes = {fmt: parameter_bytes(layer) for fmt, layer in layers.items()}
    shape = dict(experts=experts, hidden=hidden, inter=CUDA_LAYER[2], top_k=top_k)
    return {"layer": shape, "bytes": sizes, "runs": runs}


def report(result: dict) -> None:
    sizes = result["bytes"]
    ratio = sizes["mxfp4"]["experts"] / sizes["16-bit"]["experts"]
    whole = sizes["mxfp4"]["weights"] / sizes["16-bit"]["weights"]
    print(
        f"\nexperts: mxfp4 {sizes['mxfp4']['experts'] / 2**20:.1f} MiB, bfloat16 "
        f"{sizes['16-bit']['experts'] / 2**20:.1f} MiB: {ratio:.3f}x (goal <= 0.3x); "
        f"all weights {whole:.3f}x"
    )
    best, cpu = result["best"], result["least_cpu_ms_per_token"]
    base, base_cpu = best["transformers generate_batch"], cpu["transformers generate_batch"]
    print(
        "\n| arm | output tok/s (best round) | vs transformers | CPU ms/token (least) "
        "| vs transformers |\n|---|---:|---:|---:|---:|"
    )
    for name, rate in best.items():
        print(
            f"| {name} | {rate:.1f} | {rate / base:.2f}x | {cpu[name]:.2f} "
            f"| {base_cpu / cpu[name]:.2f}x |"
        )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for gpt_oss_throughput.json")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=3, help="CPU: rounds of the three arms")
    p.add_argument("--tokens", type=int, default=64, help="CPU: output tokens per request")
    p.add_argument("--iters", type=int, default=20, help="CUDA: layer calls per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="CUDA: timed repeats")
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads")
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    study = cpu_study(args) if args.device == "cpu" else cuda_study(args)
    result = {"env": device_environment(args.device), "args": vars(args)} | study
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpt_oss_throughput.json").write_text(json.dumps(result, indent=2))
    if args.device == "cpu":
        report(result)
    return result


if __name__ == "__main__":
    main()
