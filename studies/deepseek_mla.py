"""DeepSeek-V3's multi-head latent attention in kvgate's engine: what its compressed KV
cache holds, and how fast the engine decodes an MLA model.

    python -m studies.deepseek_mla --out OUTDIR [--num-requests 64] [--threads 2]
    python -m studies.deepseek_mla --device cuda --out OUTDIR     # the GPU measurement

On the CPU, in one run:
- KV: an engine of DeepSeek-V3's attention geometry (61 layers, 128 heads of qk 128 + 64
  and v 128, a latent of 512 and a rotary key of 64, bfloat16; its hidden size, MLPs and
  vocabulary small, which no cache depends on, random weights) is given a fixed KV
  budget, and so is the same geometry with every head's key and value cached: a Llama of
  61 layers and 128 KV heads of 160, whose key and value rows (160 + 160) are exactly
  DeepSeek's 192 + 128 a head. Each engine's allocation says its bytes per token and
  how many sequences of --seq-len tokens the budget holds. MLA's promise is the ratio
  128 x (192 + 128) / (512 + 64) = 71.1.
- Decode: 16 requests of 128 prompt tokens and 128 output tokens at once (greedy,
  ignore_eos) on a random DeepSeek-V3 of arch_throughput's Llama shape (hidden 512, 8
  layers, 8 heads, vocabulary 32000) with MLA and DeepSeek's MoE in its proportions,
  kvgate `LLM.generate` against transformers' continuous batching (what
  `generate_batch` drives), engine_throughput's two runners, interleaved over rounds.

On CUDA: the MLA kernel (layers/triton_mla.py) decoding at DeepSeek-V3's widths, 16
heads (a rank of TP 8) and 128, against the dense kernel (triton_attention.py) over
every head's keys and values (K and V 192 wide, V padded as the kernel needs), per
layer and step; and the latent bytes it read a second. Writes OUTDIR/deepseek_mla.json
and prints what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
from pathlib import Path

import torch

from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama
from studies.engine_throughput import VOCAB, run_hf_continuous, run_kvgate
from studies.harness import TINY_LLAMA, device_environment

# DeepSeek-V3's attention; the rest of the model small (no cache depends on it)
V3_ATTENTION = dict(
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=64,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)
SMALL_REST = dict(hidden_size=256, intermediate_size=256, vocab_size=VOCAB)
SMALL_MOE = dict(
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_group=1, topk_group=1
)
# the decode model: arch_throughput's Llama shape with MLA and DeepSeek's MoE in its
# proportions (latent a quarter of the hidden size, rotary half a head, 16 experts of an
# eighth of the dense MLP in 4 groups, top 4 from 2 groups, one shared, layer 0 dense)
DECODE_SHAPE = dict(
    hidden_size=TINY_LLAMA["hidden_size"],
    intermediate_size=1024,
    num_hidden_layers=TINY_LLAMA["num_layers"],
    num_attention_heads=TINY_LLAMA["num_heads"],
    num_key_value_heads=TINY_LLAMA["num_heads"],
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=1024,
    vocab_size=VOCAB,
    initializer_range=0.02,
    bos_token_id=1,  # bench.tiny_model's tokenizer
    eos_token_id=2,
    pad_token_id=0,
)
HF_CACHE_BLOCKS = 256


def promised_ratio() -> float:
    """Every head's key and value over MLA's one row, a layer: 71.1 for DeepSeek-V3."""
    a = V3_ATTENTION
    full = a["num_attention_heads"] * (
        a["qk_nope_head_dim"] + a["qk_rope_head_dim"] + a["v_head_dim"]
    )
    return full / (a["kv_lora_rank"] + a["qk_rope_head_dim"])


def write_config_dirs(root: Path) -> dict[str, str]:
    """Config-only model directories (load_format "dummy" reads no weights) with
    bench.tiny_model's tokenizer: DeepSeek-V3's attention, and the full-head Llama."""
    from transformers import DeepseekV3Config, LlamaConfig

    tokenizer_dir = build_tiny_llama(
        root / "tokenizer",
        hidden_size=64,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        vocab_size=VOCAB,
    )
    a = V3_ATTENTION
    full_head = (a["qk_nope_head_dim"] + a["qk_rope_head_dim"] + a["v_head_dim"]) // 2
    configs = {
        "mla": DeepseekV3Config(
            **V3_ATTENTION,
            **SMALL_REST,
            **SMALL_MOE,
            first_k_dense_replace=3,
            architectures=["DeepseekV3ForCausalLM"],
        ),
        "full heads": LlamaConfig(
            num_hidden_layers=a["num_hidden_layers"],
            num_attention_heads=a["num_attention_heads"],
            num_key_value_heads=a["num_attention_heads"],
            head_dim=full_head,
            **SMALL_REST,
            architectures=["LlamaForCausalLM"],
        ),
    }
    dirs = {}
    for name, config in configs.items():
        path = root / name.replace(" ", "-")
        config.save_pretrained(path)
        for f in os.listdir(tokenizer_dir):
            if "token" in f:
                (path / f).write_bytes((tokenizer_dir / f).read_bytes())
        dirs[name] = str(path)
    return dirs


def kv_study(args) -> dict:
    """Each engine's cache under the same budget: bytes a token, sequences held."""
    from backend_gpu import LLM, SamplingParams
    from backend_gpu.memory import full_heads_kv_bytes_per_token

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in write_config_dirs(Path(tmp)).items():
            llm = LLM(
                path,
                load_format="dummy",
                dtype="bfloat16",
                kv_cache_memory_bytes=args.kv_budget_mib << 20,
                max_model_len=args.seq_len,
                max_num_batched_tokens=max(args.seq_len, 256),
            )
            stats = llm.stats()
            tokens = stats.num_blocks * llm.engine.config.block_size
            row = {
                "kv_cache_bytes": stats.kv_cache_bytes,
                "num_blocks": stats.num_blocks,
                "bytes_per_token": stats.kv_cache_bytes // tokens,
                "sequences": stats.num_blocks // -(-args.seq_len // llm.engine.config.block_size),
                "cache_shape": list(llm.engine.runner.attention_layers[0].k_cache.shape[1:]),
            }
            if name == "mla":  # it runs: a prompt to the end of its window
                gen = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
                row["generated"] = len(gen[0].token_ids)
                row["plan_full_heads_bytes_per_token"] = full_heads_kv_bytes_per_token(
                    llm.engine.hf_config, 2
                )
            out[name] = row
            print(f"{name}: {row}", flush=True)
            del llm
            gc.collect()
    mla, full = out["mla"], out["full heads"]
    out["bytes_ratio"] = full["bytes_per_token"] / mla["bytes_per_token"]
    out["sequences_ratio"] = full["sequences"] and mla["sequences"] / full["sequences"]
    out["promised_ratio"] = promised_ratio()
    return out


def write_decode_model(root: Path, seed: int) -> tuple[str, int]:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    shape = TINY_LLAMA | {"vocab_size": VOCAB, "max_position_embeddings": 1024}
    path = build_tiny_llama(root / "deepseek", **shape, seed=seed)  # for its tokenizer
    (path / "model.safetensors").unlink()
    torch.manual_seed(seed)
    config = DeepseekV3Config(**DECODE_SHAPE, architectures=["DeepseekV3ForCausalLM"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return str(path), sum(p.numel() for p in model.parameters())


def decode_study(args) -> dict:
    """--batch requests of --prompt-tokens and --output-tokens at once, kvgate against
    transformers' continuous batching, the arms interleaved round by round (the machine
    is shared: a round's load falls on both), the best round of each counting."""
    from transformers import ContinuousBatchingConfig

    rng = random.Random(args.seed)
    requests = [
        ([rng.randrange(3, VOCAB) for _ in range(args.prompt_tokens)], args.output_tokens)
        for _ in range(args.batch)
    ]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        path, params = write_decode_model(Path(tmp), args.seed)
        for r in range(args.rounds):
            ours, _ = run_kvgate(path, requests, "continuous", args.batch, args)
            gc.collect()
            cache = ContinuousBatchingConfig(num_blocks=HF_CACHE_BLOCKS)
            theirs = run_hf_continuous(path, requests, cache)
            gc.collect()
            rounds.append({"kvgate": ours.tokens_per_s, "transformers": theirs.tokens_per_s})
            print(f"round {r + 1}: {rounds[-1]}", flush=True)
    best = {arm: max(r[arm] for r in rounds) for arm in rounds[0]}
    ratio = best["kvgate"] / best["transformers"]
    print(f"decode, best rounds: {best} ({ratio:.2f}x)", flush=True)
    return {"parameters": params, "rounds": rounds, "best": best, "ratio": ratio}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for deepseek_mla.json")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--kv-budget-mib", type=int, default=3072, help="each engine's KV budget")
    p.add_argument("--seq-len", type=int, default=32, help="the sequences the budget holds")
    p.add_argument("--batch", type=int, default=16, help="decode: requests at once")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-gib", type=int, default=2, help="the decode engine's")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    if args.device == "cuda":
        from studies.deepseek_mla_gpu import gpu_study

        result = {"env": device_environment("cuda"), "kernels": gpu_study()}
    else:
        torch.set_num_threads(args.threads)
        result = {"env": device_environment("cpu"), "args": vars(args)}
        result["kv"] = kv_study(args)
        result["decode"] = decode_study(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "deepseek_mla.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
