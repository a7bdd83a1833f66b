"""Issue 7's two benchmarks through `kvgate bench serve`, both arms of each in one run:

1. caching: one replica, a shared system prompt of `--prefix-len` tokens and short
   questions: TTFT with prefix caching against the same engine with it off.
2. routing: two replicas, `--tenants` tenants each with its own system prompt, each
   replica's KV pool sized to hold `--pool-prompts` of them (fewer than all): the
   prefix-aware router against round robin.

The engine runs bench.tiny_model's random Llama (hidden 512, 8 layers; the word-level
tokenizer makes one word one token) on the CPU. Rounds alternate the arms (A B A B ...),
so that noise on a shared machine falls on both. In the routing runs the tenants send
in random order (a strict turn-taking order would line round robin up with the tenants
by accident), and each round first sends one request per tenant, unmeasured: the steady
state the router is for, where every system prompt has been seen once.

    .venv/bin/python -m studies.prefix_routing --out docs/perf/prefix_routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama, parameter_count
from studies.harness import (
    TINY_LLAMA,
    backend_rows,
    kv_block_bytes,
    start_gateway,
    tenant_key,
    toml_backend,
)

BLOCK_SIZE = 16
MODEL_SHAPE = TINY_LLAMA | {"vocab_size": 32000, "max_position_embeddings": 4096}


class Gateway:
    """A `kvgate serve` process (studies.harness) with its own config and database: a
    SQLite file, or a schema of its own in `database_url`'s PostgreSQL, dropped at stop."""

    def __init__(self, workdir: Path, name: str, config: str, database_url: str, *flags: str):
        self.database_url, self.schema, env = database_url, None, {}
        if database_url.startswith("postgresql"):
            self.schema = f"kvgate_bench_{name.replace('-', '_')}_{os.getpid()}"
            env = {"KVGATE_DATABASE_URL": database_url, "KVGATE_DATABASE_SCHEMA": self.schema}
        self.process = start_gateway(workdir, name, config, *flags, env=env)
        self.url = self.process.url

    def tenant_keys(self, n: int) -> list[str]:
        return [tenant_key(self.url, f"tenant-{i}") for i in range(n)]

    def stop(self) -> None:
        self.process.stop()
        if self.schema:
            asyncio.run(drop_schema(self.database_url, self.schema))


async def drop_schema(database_url: str, schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


def bench_serve(
    gw: Gateway,
    keys: list[str],
    model: str,
    out: Path,
    args,
    seed: int,
    num_prompts: int,
    concurrency: int,
    order: str = "random",
) -> dict:
    """One `kvgate bench serve` run (each tenant its own system prompt, sent in `order`);
    its JSON result."""
    cmd = (
        [sys.executable, "-m", "bench", "serve", "--url", gw.url, "--model", model]
        + ["--api-key", ",".join(keys), "--num-tenants", str(len(keys))]
        + ["--dataset", "shared-prefix", "--shared-prefix-len", str(args.prefix_len)]
        + ["--num-prefixes", str(len(keys)), "--prefix-order", order]
        + ["--input-len", str(args.question_len), "--output-len", str(args.output_len)]
        + ["--ignore-eos", "--temperature", "0"]
        + ["--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency)]
        + ["--seed", str(seed), "--percentile-metrics", "ttft,e2el"]
        + ["--metric-percentiles", "50,90,99", "--no-progress", "--save-result", str(out)]
        + ["--save-detailed"]
    )
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    if result["failed"]:
        raise RuntimeError(f"{out}: {result['failed']} requests failed: {result['errors'][:3]}")
    return result


def summary(results: list[dict]) -> dict:
    ttfts = [t * 1000 for r in results for t in r["ttfts"]]
    cached = sum(r["total_cached_tokens"] for r in results)
    prompt = sum(r["total_input_tokens"] for r in results)
    kept = ("median_ttft_ms", "total_cached_tokens", "total_input_tokens", "duration")
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p90_ms": statistics.quantiles(ttfts, n=10)[-1],
        "hit_rate": cached / prompt,  # cached prompt tokens / prompt tokens
        "runs": [{k: r[k] for k in kept} for r in results],
    }


def run_caching(args, model: str, workdir: Path, bar: tqdm) -> dict:
    pool = {"kv_cache_memory_bytes": args.block_bytes * 2048}
    config = toml_backend("cache", "gpu", "tiny-cache", model, **pool) + toml_backend(
        "nocache", "gpu", "tiny-nocache", model, enable_prefix_caching=False, **pool
    )
    gw = Gateway(workdir, "caching", config, args.database_url)
    try:
        keys = gw.tenant_keys(1)
        results: dict[str, list[dict]] = {"cache": [], "nocache": []}
        for r in range(args.rounds):
            for arm in ("cache", "nocache"):
                out = workdir / f"caching-{arm}-{r}.json"
                result = bench_serve(gw, keys, f"tiny-{arm}", out, args, r, args.caching_prompts, 1)
                results[arm].append(result)
                bar.update(1)
    finally:
        gw.stop()
    return {arm: summary(rs) for arm, rs in results.items()}


def run_routing(args, model: str, workdir: Path, bar: tqdm) -> dict:
    engine = {"replicas": 2, "kv_cache_memory_bytes": args.block_bytes * args.pool_blocks}
    config = toml_backend("tiny", "gpu", "tiny", model, **engine)
    gateways = {}
    for policy in ("prefix", "round_robin"):
        flags = ("--router-policy", policy)
        gateways[policy] = Gateway(workdir, f"routing-{policy}", config, args.database_url, *flags)
    try:
        keys = {policy: gw.tenant_keys(args.tenants) for policy, gw in gateways.items()}
        results: dict[str, list[dict]] = {policy: [] for policy in gateways}
        prompts, concurrency = args.routing_prompts, args.concurrency
        for r in range(args.rounds):
            for policy, gw in gateways.items():
                seed = 100 + r  # a new set of system prompts each round, the same for both arms
                warm = workdir / f"routing-{policy}-{r}-warmup.json"
                bench_serve(gw, keys[policy], "tiny", warm, args, seed, args.tenants, 1, "cycle")
                out = workdir / f"routing-{policy}-{r}.json"
                result = bench_serve(
                    gw, keys[policy], "tiny", out, args, seed, prompts, concurrency
                )
                results[policy].append(result)
                bar.update(1)
        report = {policy: summary(rs) for policy, rs in results.items()}
        for policy, gw in gateways.items():
            report[policy]["replicas"] = [
                {k: b[k] for k in ("name", "prefix_queries", "prefix_hits")}
                for b in backend_rows(gw.url)
            ]
    finally:
        for gw in gateways.values():
            gw.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m studies.prefix_routing",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--prefix-len", type=int, default=1000, help="system prompt tokens")
    p.add_argument("--question-len", type=int, default=16, help="question tokens")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds per benchmark")
    p.add_argument("--caching-prompts", type=int, default=16, help="per arm and round")
    p.add_argument("--routing-prompts", type=int, default=64, help="per arm and round")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4, help="routing: requests in flight")
    p.add_argument(
        "--pool-prompts",
        type=float,
        default=5,
        help="routing: one replica's KV pool, in whole prompts",
    )
    p.add_argument("--only", choices=["caching", "routing"])
    p.add_argument(
        "--database-url",
        default="sqlite",
        help="sqlite (a file per gateway) or a postgresql+asyncpg:// URL",
    )
    p.add_argument("--out", default="docs/perf/prefix_routing.json")
    args = p.parse_args(argv)
    args.block_bytes = kv_block_bytes(MODEL_SHAPE, BLOCK_SIZE)
    prompt_tokens = 1 + args.prefix_len + args.question_len + args.output_len  # 1: a BOS
    args.pool_blocks = int(args.pool_prompts * -(-prompt_tokens // BLOCK_SIZE))
    with tempfile.TemporaryDirectory(prefix="kvgate-prefix-bench-") as tmp:
        workdir = Path(tmp)
        model = str(build_tiny_llama(workdir / "tiny-llama", **MODEL_SHAPE))
        report: dict = {
            "model": f"bench.tiny_model random Llama, {parameter_count(model) / 1e6:.1f}M params",
            "machine": f"{os.cpu_count()} CPUs, shared with other engineers",
            "args": {k: v for k, v in vars(args).items() if k != "only"},
        }
        todo = [args.only] if args.only else ["caching", "routing"]
        with tqdm(total=2 * args.rounds * len(todo), desc="bench runs") as bar:
            if "caching" in todo:
                report["caching"] = run_caching(args, model, workdir, bar)
            if "routing" in todo:
                report["routing"] = run_routing(args, model, workdir, bar)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
