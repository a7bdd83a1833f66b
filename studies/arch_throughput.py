"""The engine-throughput study (studies/engine_throughput.py) over the architectures
issue 47 added: Qwen2-MoE, Phi-3 and Gemma 3 as published, each of the Llama's shape there
and on its workload, against transformers' continuous batching, with that Llama beside
them in the same run.

    python -m studies.arch_throughput --out OUTDIR [--num-requests 64] [--threads 2]

Each model has random weights (transformers' initializer, the Llama's normal(0, 0.02)),
engine_throughput's word-level tokenizer and its shape: hidden 512, 8 layers, 8 query
heads of 64 over 4 KV heads, MLP 1024, a vocabulary of 32000, 1024 positions; what the
architecture adds is in its own form:
- qwen2_moe: each layer 16 experts of 128 with top 4 (not renormalized) and a shared
  expert of 512 behind its sigmoid gate (the active MLP the Llama's 1024, in
  Qwen1.5-MoE-A2.7B's proportions), q/k/v biased;
- phi3: fused checkpoint tensors, rotary on 3/4 of each head, LongRoPE from 512 original
  positions (Phi-4-mini's form), tied head;
- gemma3_mm: Gemma3ForConditionalGeneration, its text model's layers a 128-token window
  but the sixth (global, linear rope scaling 8), beside a small SigLIP tower.
The workload is engine_throughput's (`--num-requests` requests, prompts 32-512 tokens,
outputs 16-256, greedy, ignore_eos, all at once), run by kvgate `LLM.generate` (timed
after `LLM(...)` returns) and by transformers' continuous batching manager (what
`generate_batch` drives, timed after its set-up), engine_throughput's two runners. The
caches are sized for the workload (kvgate `--kv-cache-gib`; transformers 256 blocks of
256 tokens and batches of `--max-num-batched-tokens`, as kvgate's): left to size its own
from the free memory, transformers' took 13 GB of a shared machine's RAM. Writes
OUTDIR/arch_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
from pathlib import Path

import torch

from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama
from studies.engine_throughput import VOCAB, run_hf_continuous, run_kvgate, workload
from studies.harness import TINY_LLAMA, device_environment

ARCHS = ("llama", "qwen2_moe", "phi3", "gemma3_mm")
SHAPE = dict(
    hidden_size=TINY_LLAMA["hidden_size"],
    intermediate_size=2 * TINY_LLAMA["hidden_size"],  # bench.tiny_model's Llama MLP
    num_hidden_layers=TINY_LLAMA["num_layers"],
    num_attention_heads=TINY_LLAMA["num_heads"],
    num_key_value_heads=TINY_LLAMA["num_kv_heads"],
    max_position_embeddings=1024,
    vocab_size=VOCAB,
    initializer_range=0.02,
    bos_token_id=1,  # bench.tiny_model's tokenizer
    eos_token_id=2,
    pad_token_id=0,
)
HF_CACHE_BLOCKS = 256


def arch_config(arch: str):
    from transformers import Gemma3Config, Phi3Config, Qwen2MoeConfig

    if arch == "qwen2_moe":
        experts = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128)
        return Qwen2MoeConfig(
            **SHAPE,
            **experts,
            shared_expert_intermediate_size=512,
            norm_topk_prob=False,
            architectures=["Qwen2MoeForCausalLM"],
        )
    if arch == "phi3":
        half = 64 * 3 // 4 // 2  # of the rotated dimensions
        rope = {
            "type": "longrope",
            "short_factor": [1.0 + i / half for i in range(half)],
            "long_factor": [1.0 + 8 * i / half for i in range(half)],
        }
        return Phi3Config(
            **SHAPE,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=512,
            rope_scaling=rope,
            tie_word_embeddings=True,
            architectures=["Phi3ForCausalLM"],
        )
    text = dict(SHAPE, head_dim=64, sliding_window=128, query_pre_attn_scalar=64)
    text["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    vision.update(num_attention_heads=2, image_size=32, patch_size=8)
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 4,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        architectures=["Gemma3ForConditionalGeneration"],
    )


def write_model(arch: str, directory: Path, seed: int) -> tuple[str, int]:
    """The random model's directory, with engine_throughput's tokenizer, and the
    parameters of what the engine serves of it (not Gemma 3's vision tower)."""
    from transformers import AutoModelForCausalLM

    shape = TINY_LLAMA | {"vocab_size": VOCAB, "max_position_embeddings": 1024}
    path = build_tiny_llama(directory / arch, **shape, seed=seed)
    if arch == "llama":
        model = AutoModelForCausalLM.from_pretrained(path)
    else:
        (path / "model.safetensors").unlink()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(arch_config(arch), dtype=torch.float32)
        model.save_pretrained(path)
    vision = ("vision_tower", "multi_modal_projector")
    served = sum(p.numel() for n, p in model.named_parameters() if not any(v in n for v in vision))
    return str(path), served


def study(args) -> dict:
    from transformers import ContinuousBatchingConfig

    requests = workload(args.num_requests, args.seed)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs:
            path, params = write_model(arch, Path(tmp), args.seed)
            ours, _ = run_kvgate(path, requests, "continuous", args.max_num_seqs, args)
            gc.collect()
            cache = ContinuousBatchingConfig(
                num_blocks=HF_CACHE_BLOCKS, max_batch_tokens=args.max_num_batched_tokens
            )
            theirs = run_hf_continuous(path, requests, cache)
            gc.collect()
            runs[arch] = {
                "parameters": params,
                "kvgate": dataclasses.asdict(ours),
                "transformers": dataclasses.asdict(theirs),
            }
            print(
                f"{arch}: kvgate {ours.tokens_per_s:.1f} tok/s, transformers "
                f"{theirs.tokens_per_s:.1f} tok/s ({ours.tokens_per_s / theirs.tokens_per_s:.2f}x)",
                flush=True,
            )
    return runs


def report(runs: dict) -> None:
    print(
        "\n| architecture | parameters | kvgate output tok/s | transformers output tok/s "
        "| kvgate is |\n|---|---:|---:|---:|---:|"
    )
    for arch, run in runs.items():
        ours, theirs = run["kvgate"], run["transformers"]
        rate = ours["output_tokens"] / ours["seconds"]
        base = theirs["output_tokens"] / theirs["seconds"]
        print(
            f"| {arch} | {run['parameters'] / 1e6:.1f}M | {rate:.1f} | {base:.1f} "
            f"| {rate / base:.2f}x |"
        )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for arch_throughput.json")
    p.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = study(args)
    result = {"env": device_environment("cpu"), "args": vars(args), "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "arch_throughput.json").write_text(json.dumps(result, indent=2))
    report(runs)
    return result


if __name__ == "__main__":
    main()
