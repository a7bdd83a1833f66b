"""`kvgate plan`: which GPU a model needs, before downloading it to one. Prints what
backend_gpu.memory_plan computes with the engine's own memory sums: weight bytes per
format, KV bytes per token, KV blocks and concurrent sequences at a context length,
and the smallest tensor-parallel size that fits."""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from dataclasses import asdict
from typing import Any

from backend_gpu.plan_inputs import CUDA_CONTEXT_BYTES, PlanDevice, PlanSettings, check_model_path

GIB = 1 << 30
MIB = 1 << 20
# named cards: the memory nvidia-smi reports for each (MiB)
CARDS_MIB = {
    "h200": 143_771,
    "h100-80gb": 81_559,
    "a100-80gb": 81_920,
    "a100-40gb": 40_960,
    "l40s": 46_068,
    "a10g": 23_028,
    "l4": 23_034,
    "rtx-4090": 24_564,
}
NOTE_INDENT = " " * 11  # under the values of the lines above
UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": MIB, "gib": GIB, "tib": 1 << 40}
UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS |= {"k": 1 << 10, "m": MIB, "g": GIB, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of `80GiB`, `40GB` (10^9), `81559MiB`, `24g` (GiB) or a plain number."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 80GiB, 40GB, 24000MiB)")
    return int(float(match.group(1)) * UNITS[unit])


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="the GPU memory a model needs: weights, KV cache, sequences, TP size"
    )
    p.add_argument("model", nargs="?", help="HF directory, GGUF file or config.json")
    p.add_argument(
        "--gpu-memory",
        metavar="SIZE|CARD",
        help=f"a size (80GiB, 40GB) or a card ({', '.join(CARDS_MIB)}); "
        "default: the GPU torch sees",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F")
    p.add_argument("--max-model-len", type=int, metavar="N", help="default: the model's")
    p.add_argument(
        "--tensor-parallel-size", type=int, metavar="N", help="default: the smallest that fits"
    )
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--quantization", choices=["fp8", "int8", "int4"], help="weights' format")
    p.add_argument("--int4-group-size", type=int, default=128, metavar="N")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256, metavar="N")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N")
    p.add_argument("--block-size", type=int, default=16, metavar="N")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--kv-cache-memory",
        metavar="SIZE",
        help="the KV cache's bytes outright (the engine's kv_cache_memory_bytes)",
    )


def device_of_spec(spec: str) -> PlanDevice:
    """The PlanDevice of --gpu-memory: a card's name or a size."""
    if spec.lower() in CARDS_MIB:
        return PlanDevice(spec.lower(), CARDS_MIB[spec.lower()] * MIB, CUDA_CONTEXT_BYTES)
    return PlanDevice(spec, parse_size(spec), CUDA_CONTEXT_BYTES)


def detect_device() -> PlanDevice:
    """The PlanDevice of the GPU torch sees."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"torch sees no GPU: give --gpu-memory SIZE or a card ({', '.join(CARDS_MIB)})"
        )
    free, total = torch.cuda.mem_get_info()
    # in use now: other processes and this one's CUDA context, as the engine's would be
    return PlanDevice(torch.cuda.get_device_name(), total, total - free)


def run(args: argparse.Namespace) -> int:
    try:
        # every argument checked first: torch (memory_plan's, and the GPU's detection)
        # takes seconds to import, and a typo should not wait for it
        settings = plan_settings(args)
        if args.model is None:
            from gateway.backends.default_model import default_model_path

            args.model = str(default_model_path())
        check_model_path(args.model)
        device = device_of_spec(args.gpu_memory) if args.gpu_memory else None

        from backend_gpu.memory_plan import plan_memory

        plan = plan_memory(args.model, device or detect_device(), settings)
    except (OSError, ValueError, NotImplementedError) as e:
        print(f"kvgate plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_json(plan), indent=2))
    else:
        print(format_plan(plan))
    return 0 if plan.chosen else 1


def plan_settings(args: argparse.Namespace) -> PlanSettings:
    return PlanSettings(
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        quantization=args.quantization,
        int4_group_size=args.int4_group_size,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
    )


def plan_json(plan) -> dict:
    out = asdict(plan)
    for rank, row in zip(plan.ranks, out["ranks"], strict=True):
        row["fits"] = rank.fits
        row["kv"]["cache_bytes"] = rank.kv.cache_bytes
    out["chosen_tp_size"] = plan.chosen.tp_size if plan.chosen else None
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


def _int4_note(plan) -> str:
    """Why int4 is not the smallest: the token table, most of this model, stays 16-bit."""
    share = plan.token_table_parameters / plan.parameters
    note = (
        "int4 is larger than int8 here: int4 packs the decoder layers and keeps "
        f"the token table in {plan.settings.dtype}, as GPTQ and AWQ checkpoints ship it; "
        f"int8 and fp8 store the table in 8 bits, and it is "
        f"{plan.token_table_parameters / 1e6:.1f}M of this model's "
        f"{plan.parameters / 1e6:.1f}M parameters ({share:.0%}). A checkpoint with its "
        f"table in int4 too takes {_gib(plan.int4_packed_table_bytes)}."
    )
    return textwrap.fill(note, 92, initial_indent=NOTE_INDENT, subsequent_indent=NOTE_INDENT)


def format_plan(plan) -> str:
    s = plan.settings
    lines = [
        f"model      {plan.model} ({plan.architecture}, {plan.parameters / 1e9:.3f}B parameters)",
        f"device     {plan.device.name}: {_gib(plan.device.total_bytes)}, "
        f"{_gib(plan.device.in_use_bytes)} in use before the model; utilization "
        f"{s.gpu_memory_utilization}",
        "weights    "
        + ", ".join(
            f"{fmt + (f'-g{s.int4_group_size}' if fmt == 'int4' else '')} {_gib(n)}"
            for fmt, n in plan.weight_bytes.items()
        ),
        "KV/token   "
        + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in plan.kv_bytes_per_token.items())
        + f" ({plan.num_layers} layers, every one held in full)",
    ]
    if plan.weight_bytes["int4"] >= plan.weight_bytes["int8"]:
        lines.append(_int4_note(plan))
    if plan.expert_bytes:
        packed, whole = plan.expert_bytes["mxfp4"], plan.expert_bytes[s.dtype]
        lines.append(
            f"experts    MXFP4 as the checkpoint ships them, kept so: {_gib(packed)} "
            f"({packed / whole:.2f}x of {s.dtype}'s {_gib(whole)})"
        )
    if plan.fp8_tiles:
        rows, cols = plan.fp8_tiles
        lines.append(
            f"checkpoint FP8 in {rows}x{cols} tiles (block-wise fp8), widened to {s.dtype} "
            f"as it loads ({_gib(plan.weight_bytes[s.dtype])}); --quantization fp8 holds "
            f"it in FP8 ({_gib(plan.weight_bytes['fp8'])})"
        )
    if plan.full_heads_kv_bytes_per_token:
        latent = plan.kv_bytes_per_token[s.kv_cache_dtype]
        full = plan.full_heads_kv_bytes_per_token
        lines.append(
            f"latent     one MLA row a token and layer, whole on every rank: "
            f"{latent / 1024:.1f} KiB against {full / 1024:.1f} KiB for every head's key "
            f"and value ({full / latent:.1f}x)"
        )
    if plan.sliding_layers:
        whole = plan.kv_bytes_per_token[s.kv_cache_dtype] * plan.max_model_len
        lines.append(
            f"windows    {plan.sliding_layers} of {plan.num_layers} layers slide over "
            f"{plan.sliding_window} tokens, but kvgate caches them in full, as the blocks "
            f"below count: a {plan.max_model_len}-token sequence takes {_gib(whole)} "
            f"(a window-aware cache: {_gib(plan.kv_bytes_per_seq_windowed)})"
        )
    quant = s.quantization or s.dtype
    if plan.expert_bytes:  # the checkpoint's experts stay MXFP4 whatever the rest is in
        quant += ", experts mxfp4"
    lines.append(
        f"\nper rank, weights {quant}, KV {s.kv_cache_dtype}, max_model_len "
        f"{plan.max_model_len}, blocks of {s.block_size} tokens:"
    )
    header = ("TP", "weights", "activations", "CUDA graphs", "KV budget", "blocks", "seqs", "fits")
    rows = [header] + [
        (
            str(r.tp_size),
            _gib(r.weight_bytes),
            _gib(r.activation_bytes),
            _gib(r.graph_pool_bytes),
            _gib(r.kv.budget),
            str(r.kv.num_blocks),
            str(r.max_concurrent_seqs),
            "yes" if r.fits else "no",
        )
        for r in plan.ranks
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    chosen = plan.chosen
    lines.append(
        f"\nsmallest tensor-parallel size that fits: {chosen.tp_size} "
        f"({chosen.max_concurrent_seqs} sequences of {plan.max_model_len} tokens at once)"
        if chosen
        else "\nno tensor-parallel size fits: lower --max-model-len, quantize, or a larger GPU"
    )
    return "\n".join(lines)
