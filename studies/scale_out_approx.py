"""studies.scale_out's part 4 (`--only approx`): approximate prefix routing, for upstreams
that report no KV events, over two llama-cpp-python servers, against round robin.

The gateway cannot see such a server's cache; it remembers which prompt blocks it sent
to which replica (gateway/backends/remote_sent.py) and routes a tenant's system prompt
back there. What that buys depends on the server's cache, so the part measures that
first: llama-cpp-python's server (one context, no `--cache`) reuses only the longest
common prefix with the last prompt it ran. Its RAM cache (`--cache`) is left off: each
entry also copies the logits buffer (a float per vocabulary entry, 262k for Gemma, for up
to n_batch prompt tokens: about 0.4 GB for a 400-token prompt), which its byte limit
does not count.

So a server holds one tenant's prompt at a time, and the workload is swept over the
number of tenants: with as many tenants as servers, routing can keep each server on one
tenant; with more, a server's next request is its last one's tenant only by chance
(about servers/tenants of the time under prefix routing, 1/tenants under round robin).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench.datasets import shared_prefix_requests
from bench.metrics import percentile
from gateway.backends.default_model import default_model_path
from studies.harness import start_gateway, tenant_key, toml_backend
from studies.local_vs_llama_server import MODEL_ID, llama_cpp_server
from studies.scale_out_procs import measure
from studies.scale_out_report import pooled

SERVER_CTX = 2048  # tokens: a ~400-token prompt, its question and output, with room
SERVER_BATCH = 512


def run_approx(args: argparse.Namespace, workdir: Path, say: Callable[[str], None]) -> dict:
    model = str(default_model_path())
    # llama_cpp_server's settings: one thread each, the test fixture's context size
    server_args = argparse.Namespace(ctx_per_seq=SERVER_CTX, threads=1, batch=SERVER_BATCH)
    with contextlib.ExitStack() as stack:
        say("approximate routing: starting 2 llama-cpp-python servers")
        urls = [
            stack.enter_context(llama_cpp_server(workdir, server_args, model, interrupt=False))
            for _ in range(2)
        ]
        report: dict = {
            "upstream": "llama_cpp.server (llama-cpp-python), default Gemma 3 270M Q4_K_M GGUF, "
            f"--n_threads 1 --n_ctx {SERVER_CTX} --interrupt_requests False, no --cache",
            "server_cache": _probe_cache(args, urls[0], say),
            "policies": {},
        }
        # the server reports no cached tokens: the share of TTFTs under the geometric
        # mean of the probe's hit and miss stands in (a hit queued behind another
        # request can still land above it)
        hit, miss = (
            statistics.median(report["server_cache"][label]["ttft_ms"])
            for label in ("same prefix, next", "new prompt")
        )
        report["hit_bound_ms"] = bound = math.sqrt(hit * miss)
        config = toml_backend(
            "llama",
            "remote",
            MODEL_ID,
            urls=[url + "/v1" for url in urls],
            tokenizer=model,
            context_length=SERVER_CTX,
            read_timeout_s=300,
        )
        for policy in ("prefix", "round_robin"):
            say(f"approximate routing: --router-policy {policy}: starting the gateway")
            flags = ["--router-policy", policy]
            with start_gateway(workdir, f"approx-{policy}", config, *flags) as gw:
                keys = [tenant_key(gw.url, f"tenant-{i}") for i in range(max(args.approx_tenants))]
                report["policies"][policy] = {
                    n: _rounds(args, gw.url, keys[:n], policy, bound, say)
                    for n in args.approx_tenants
                }
    p, rr = report["policies"]["prefix"], report["policies"]["round_robin"]
    report["ttft_p50_ratio"] = {  # round robin / prefix, per number of tenants
        n: rr[n]["ttft_p50_ms"] / p[n]["ttft_p50_ms"] for n in args.approx_tenants
    }
    return report


def _probe_cache(args: argparse.Namespace, url: str, say: Callable[[str], None]) -> dict:
    """TTFT on one server, straight (no gateway), one request at a time: a new system
    prompt; the same prompt with a new question (the last prompt's prefix); the first
    prompt's again after another one ran in between."""
    shape = (args.approx_prefix_len, args.question_len, args.prefix_output_len)
    out: dict[str, list[float]] = {}
    for r in range(args.approx_rounds):  # the first round also warms the process up
        # prompts with system prompts A, B, A, B, A, B: fresh ones every round
        a1, b1, a2, _, a3, _ = shared_prefix_requests(6, *shape, num_prefixes=2, seed=7 + r)
        sequence = [("new prompt", a1), ("same prefix, next", a2), ("unrelated", b1)]
        sequence.append(("first prefix, after another", a3))
        for label, request in sequence:
            run = measure(url, ["none"], MODEL_ID, [request], 1, label)
            out.setdefault(label, []).append(run.ttft_p50_ms)
    rounded = {label: [round(v) for v in values] for label, values in out.items()}
    say(f"  the server's own cache, TTFT ms: {rounded}")
    return {label: {"ttft_ms": values} for label, values in out.items()}


def _rounds(
    args: argparse.Namespace,
    url: str,
    keys: list[str],
    policy: str,
    hit_bound_ms: float,
    say: Callable[[str], None],
) -> dict:
    """`approx_rounds` times: every tenant's system prompt sent once (the record learns
    where it went), then the measured load in random tenant order."""
    n = len(keys)
    shape = (args.approx_prefix_len, args.question_len, args.prefix_output_len)
    runs = []
    for r in range(args.approx_rounds):
        seed = 200 + 10 * n + r  # new system prompts each round, the same for both policies
        warm = shared_prefix_requests(n, *shape, num_prefixes=n, seed=seed)
        measure(url, keys, MODEL_ID, warm, 1, "warm-up")
        requests = shared_prefix_requests(
            args.approx_prompts, *shape, num_prefixes=n, seed=seed, random_order=True
        )
        runs.append(measure(url, keys, MODEL_ID, requests, args.approx_concurrency, policy))
        say(f"  {policy}, {n} tenants, round {r + 1}: TTFT p50 {runs[-1].ttft_p50_ms:.0f} ms")
    ttfts = [t for run in runs for t in run.ttfts_ms]
    return {
        **pooled(runs),
        "ttft_p90_ms": percentile(ttfts, 90),
        "fast_share": sum(t < hit_bound_ms for t in ttfts) / len(ttfts),
        "runs": [asdict(run) for run in runs],
    }
