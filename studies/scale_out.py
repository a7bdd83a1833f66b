"""Issue 14's benchmark: does running engines as worker processes pay, and what does the
gateway in front of a worker cost? One run, one configuration at a time (never two
measured servers sharing the CPU):

1. scaling: the default Gemma GGUF on llama.cpp, 16 concurrent greedy streams, through
   `kvgate serve --workers 1` (one thread), `--workers 2` (placement.py gives each a core
   and one thread) and 2 in-process replicas (`replicas = 2`, one thread each);
2. gateway overhead: one `kvgate worker --backend local` (both threads) called directly
   and through a `kvgate serve` with one `remote` entry in front of it, the two arms
   alternating over rounds so that drift on the shared machine hits both;
3. prefix routing over 2 worker processes: issue 7's workload (tenants with long system
   prompts, each worker's KV pool holding about half of them) on the gpu backend with
   bench.tiny_model's random Llama, `--router-policy prefix` against `round_robin`.
4. approximate prefix routing, only with `--only approx` (studies/scale_out_approx.py): 2
   llama-cpp-python servers that report no KV events behind one `remote` entry,
   tenants with long system prompts, `prefix` against `round_robin`.

Engine options that `kvgate serve`'s flags do not carry (threads, sequences, the KV pool)
go in a TOML [[backends]] entry, with `--workers N` on the command line.

    .venv/bin/python -m studies.scale_out      # docs/perf/scale_out.json and .png
    .venv/bin/python -m studies.scale_out --only approx --out docs/perf/scale_out_approx.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.datasets import random_requests, shared_prefix_requests
from bench.options import DefaultsHelpFormatter
from studies.harness import (
    TINY_LLAMA,
    Process,
    backend_rows,
    kv_block_bytes,
    start_gateway,
    start_worker,
    tenant_key,
    toml_backend,
)
from studies.scale_out_approx import run_approx
from studies.scale_out_procs import measure, watched, worker_commands
from studies.scale_out_report import overhead_summary, plot, pooled, print_table, ratios

GEMMA = "gemma-3-270m"
SEQ_CTX = 512  # KV cells per sequence: a 32-word prompt and 64 tokens fit with room
T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {text}", flush=True)


def local_options(parallel: int, **extra: object) -> dict:
    return {"n_parallel": parallel, "n_ctx": parallel * SEQ_CTX, **extra}


SCALING = [  # (id, label, `kvgate serve` flags, options of the [[backends]] entry)
    ("a", "1 worker, 1 thread", ["--workers", "1"], local_options(16, n_threads=1)),
    # no n_threads: placement.py splits the 2 cores and sets one thread per worker
    ("b", "2 workers, 1 thread each", ["--workers", "2"], local_options(16)),
    # the same with the router taking turns: under the default policy a burst can land
    # on one worker (each request picks from stats read before its awaited render)
    (
        "b_rr",
        "2 workers, 1 thread each, round_robin",
        ["--workers", "2", "--router-policy", "round_robin"],
        local_options(16),
    ),
    ("c", "2 in-process replicas, 1 thread each", [], local_options(16, n_threads=1, replicas=2)),
]


def prompt_tokens_by_replica(gw: Process, before: dict | None = None) -> dict[str, int]:
    """Prompt tokens each replica admitted (its `prefix_queries`), since `before`: how a
    load was split. A worker's count reaches the gateway with its stats, every 2 s."""
    time.sleep(2.5)
    rows = backend_rows(gw.url)
    return {b["name"]: b["prefix_queries"] - (before or {}).get(b["name"], 0) for b in rows}


def run_scaling(args: argparse.Namespace, workdir: Path) -> dict:
    rows = []
    for i, (ident, label, flags, options) in enumerate(SCALING):
        say(f"scaling {ident}: {label}: starting")
        config = toml_backend("local", "local", GEMMA, **options)
        with start_gateway(workdir, f"scaling-{i}", config, *flags) as gw:
            key = [tenant_key(gw.url)]
            warm = random_requests(4, args.input_len, 8, seed=1000 + i)
            measure(gw.url, key, GEMMA, warm, 4, "warm-up")
            runs, watch, splits = [], watched(gw), []
            for r in range(args.scaling_repeats):  # fresh prompts: no cache hits
                before = prompt_tokens_by_replica(gw)
                load = random_requests(args.streams, args.input_len, args.output_len, seed=r)
                runs.append(measure(gw.url, key, GEMMA, load, args.streams, label, watch))
                splits.append(prompt_tokens_by_replica(gw, before))
                say(
                    f"  {ident}: {runs[-1].tokens_per_s:.1f} tok/s, prompt tokens per "
                    f"replica {list(splits[-1].values())}"
                )
            placement = worker_commands(gw)
        rows.append(
            {
                "id": ident,
                "label": label,
                "flags": flags,
                "options": options,
                "workers": placement,
                "prompt_tokens_by_replica": splits,
                **pooled(runs),
                "runs": [asdict(r) for r in runs],
            }
        )
    return {"configurations": rows, **ratios(rows)}


@dataclass(frozen=True)
class OverheadLoad:
    """`rounds` times: `requests` requests, `concurrency` at a time, to each arm."""

    concurrency: int
    requests: int
    output_len: int
    rounds: int


@dataclass
class OverheadPlan:
    """Part 2's setup; the test runs a tiny one on the fake backend."""

    backend: str = "local"
    model_id: str = GEMMA
    worker_options: dict = field(default_factory=lambda: local_options(8, n_threads=2))
    # one stream: short rounds, many of them, so the arms interleave finely (TTFT)
    loads: list[OverheadLoad] = field(
        default_factory=lambda: [OverheadLoad(8, 8, 64, 7), OverheadLoad(1, 4, 16, 10)]
    )
    input_len: int = 32


# The gateway's own TTFT cost: the fake engine answers at once, with none of llama.cpp's
# jitter on a shared CPU (tens of ms) to hide a few ms in; its tokens/s ratio is the
# gateway's ceiling, not issue 14's goal
FAKE_OVERHEAD = OverheadPlan(
    backend="fake",
    model_id="fake-model",
    worker_options={},
    loads=[OverheadLoad(concurrency=1, requests=10, output_len=16, rounds=10)],
)


def run_overhead(plan: OverheadPlan, workdir: Path) -> dict:
    token = secrets.token_urlsafe(24)
    say(f"overhead ({plan.backend}): starting a worker and a gateway in front of it")
    worker_flags = [
        "--backend",
        plan.backend,
        "--served-model-name",
        plan.model_id,
        "--options",
        json.dumps(plan.worker_options),
    ]
    with start_worker(workdir, f"overhead-{plan.backend}-worker", token, *worker_flags) as worker:
        remote = toml_backend(
            "worker", "remote", plan.model_id, url=worker.url + "/v1", api_key=token
        )
        with start_gateway(workdir, f"overhead-{plan.backend}-gateway", remote) as gw:
            arms = {"direct": (worker.url, [token]), "gateway": (gw.url, [tenant_key(gw.url)])}
            for j, (url, key) in enumerate(arms.values()):
                warm = random_requests(2, plan.input_len, 8, seed=1000 + j)
                measure(url, key, plan.model_id, warm, 2, "warm-up")
            watch = {"gateway": gw.proc.pid, "worker": worker.proc.pid}
            loads = [_overhead_load(plan, arms, load, watch) for load in plan.loads]
    return {"backend": plan.backend, "worker_options": plan.worker_options, "loads": loads}


def _overhead_load(plan: OverheadPlan, arms: dict, load: OverheadLoad, watch: dict) -> dict:
    rounds = []
    for r in range(load.rounds):
        order = ["direct", "gateway"] if r % 2 == 0 else ["gateway", "direct"]
        runs = {}
        for j, name in enumerate(order):
            url, key = arms[name]
            # distinct prompts in every run: neither arm finds the other's in the cache
            seed = 10_000 * load.concurrency + 10 * r + j
            requests = random_requests(load.requests, plan.input_len, load.output_len, seed=seed)
            runs[name] = measure(url, key, plan.model_id, requests, load.concurrency, name, watch)
        rounds.append({"order": order, **runs})
        say(
            f"  overhead ({plan.backend}) {load.concurrency} streams, round {r + 1}/{load.rounds}: direct "
            f"{runs['direct'].tokens_per_s:.1f} tok/s, gateway {runs['gateway'].tokens_per_s:.1f}"
        )
    summary = overhead_summary([x["direct"] for x in rounds], [x["gateway"] for x in rounds])
    for x in rounds:
        x["direct"], x["gateway"] = asdict(x["direct"]), asdict(x["gateway"])
    return {
        **asdict(load),
        **summary,
        "rounds": rounds,
    }


# issue 7's routing workload (studies/prefix_routing.py), shrunk to fit the run's budget
TINY_SHAPE = TINY_LLAMA | {"vocab_size": 32000, "max_position_embeddings": 4096}
BLOCK_SIZE = 16


def run_prefix(args: argparse.Namespace, workdir: Path) -> dict:
    from bench.tiny_model import build_tiny_llama, parameter_count

    say("prefix routing: building the tiny model")
    model = str(build_tiny_llama(workdir / "tiny-llama", **TINY_SHAPE))
    block_bytes = kv_block_bytes(TINY_SHAPE, BLOCK_SIZE)
    prompt_tokens = 1 + args.prefix_len + args.question_len + args.prefix_output_len
    pool_blocks = int(args.pool_prompts * -(-prompt_tokens // BLOCK_SIZE))
    config = toml_backend(
        "tiny", "gpu", "tiny", model, kv_cache_memory_bytes=block_bytes * pool_blocks
    )
    report: dict = {
        "model": f"bench.tiny_model random Llama, {parameter_count(model) / 1e6:.1f}M params",
        "kv_pool_blocks_per_worker": pool_blocks,
        "policies": {},
    }
    for policy in ("prefix", "round_robin"):
        say(f"prefix routing: 2 workers, --router-policy {policy}: starting")
        flags = ["--workers", "2", "--router-policy", policy]
        with start_gateway(workdir, f"routing-{policy}", config, *flags) as gw:
            report["policies"][policy] = _routing_rounds(args, gw, policy)
            report["policies"][policy]["replicas"] = [
                {k: b.get(k) for k in ("name", "prefix_queries", "prefix_hits")}
                for b in backend_rows(gw.url)
            ]
    p, rr = report["policies"]["prefix"], report["policies"]["round_robin"]
    report["ttft_p50_ratio"] = rr["ttft_p50_ms"] / p["ttft_p50_ms"]  # goal >= 2
    return report


def _routing_rounds(args: argparse.Namespace, gw: Process, policy: str) -> dict:
    keys = [tenant_key(gw.url, f"tenant-{i}") for i in range(args.tenants)]
    runs = []
    for r in range(args.prefix_rounds):
        seed = 100 + r  # new system prompts each round, the same for both policies
        shape = (args.prefix_len, args.question_len, args.prefix_output_len)
        # the steady state the router is for: every tenant's system prompt seen once
        warm = shared_prefix_requests(args.tenants, *shape, num_prefixes=args.tenants, seed=seed)
        measure(gw.url, keys, "tiny", warm, 1, "warm-up")
        requests = shared_prefix_requests(
            args.routing_prompts, *shape, num_prefixes=args.tenants, seed=seed, random_order=True
        )
        runs.append(measure(gw.url, keys, "tiny", requests, args.concurrency, policy))
        say(
            f"  {policy} round {r + 1}: TTFT p50 {runs[-1].ttft_p50_ms:.0f} ms, hit rate "
            f"{runs[-1].cached_tokens / runs[-1].prompt_tokens:.1%}"
        )
    return {**pooled(runs), "runs": [asdict(r) for r in runs]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m studies.scale_out",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--streams", type=int, default=16, help="scaling: concurrent streams")
    p.add_argument("--input-len", type=int, default=32, help="prompt words (parts 1 and 2)")
    p.add_argument("--output-len", type=int, default=64, help="scaling: tokens per stream")
    p.add_argument("--scaling-repeats", type=int, default=2, help="loads per configuration")
    p.add_argument("--prefix-len", type=int, default=1000, help="routing: system prompt words")
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--prefix-output-len", type=int, default=8)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument(
        "--pool-prompts",
        type=float,
        default=5,
        help="routing: one worker's KV pool, in whole prompts",
    )
    p.add_argument("--routing-prompts", type=int, default=64, help="per policy and round")
    p.add_argument("--prefix-rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="routing: requests in flight")
    p.add_argument(
        "--approx-tenants",
        type=_counts,
        default=[2, 4, 8],
        help="approx: tenant counts to sweep, comma-separated",
    )
    p.add_argument("--approx-prefix-len", type=int, default=400, help="approx: prompt words")
    p.add_argument("--approx-prompts", type=int, default=48, help="approx: per round")
    p.add_argument("--approx-rounds", type=int, default=2)
    p.add_argument("--approx-concurrency", type=int, default=2)
    p.add_argument("--only", choices=["scaling", "overhead", "prefix", "approx"], action="append")
    p.add_argument("--out", default="docs/perf/scale_out.json")
    return p.parse_args(argv)


def _counts(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    todo = args.only or ["scaling", "overhead", "prefix"]  # approx: only when asked
    report: dict = {
        "machine": f"{os.cpu_count()} CPUs, shared with other engineers",
        "args": {k: v for k, v in vars(args).items() if k not in ("only", "out")},
    }
    with tempfile.TemporaryDirectory(prefix="kvgate-scale-out-") as tmp:
        workdir = Path(tmp)
        if "scaling" in todo:
            report["scaling"] = run_scaling(args, workdir)
        if "overhead" in todo:
            report["overhead"] = run_overhead(OverheadPlan(), workdir)
            report["overhead_fake"] = run_overhead(FAKE_OVERHEAD, workdir)
        if "prefix" in todo:
            report["prefix_routing"] = run_prefix(args, workdir)
        if "approx" in todo:
            report["approximate_routing"] = run_approx(args, workdir, say)
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print_table(report)
    say(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
