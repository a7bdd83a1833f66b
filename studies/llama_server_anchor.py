"""kvgate's llama.cpp backend against llama.cpp's own llama-server, matched and alternated.

    make llama-server        # once: builds .cache/llama-server/llama-server
    python -m studies.llama_server_anchor [--rounds 4] [--threads 1] [--out docs/perf/...]

Same GGUF (the default Gemma 3 270M), same llama.cpp commit (the one vendored in the
pinned llama-cpp-python), same threads, 8 sequences of 1,024 tokens each, flash attention
off. Both servers stay up for the whole run; each round measures one, then the other, in
A B B A / B A A B order so that neither always goes first. Per server and round:

- `concurrent`: 32 prompts of about 64 tokens in and 64 out, 8 at a time;
- `single`: right after it, 8 prompts one at a time (a lone decode beside the cells the
  concurrent run left in the cache);
- `shared`: a 900-token system prompt shared by 32 prompts, 8 at a time (kvgate reuses
  it across sequences; llama-server's cache is per slot).

Every figure comes from `kvgate bench serve`'s client (vLLM's metric definitions); a failed
request stops the run. Writes JSON and a plot of kvgate/llama-server per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.datasets import random_requests, shared_prefix_requests
from bench.options import DefaultsHelpFormatter
from gateway.backends.default_model import default_model_path
from studies.harness import (
    Process,
    free_port,
    start_gateway,
    stop_process,
    tenant_key,
    toml_backend,
    wait_http,
)
from studies.scale_out_procs import Run, measure

MODEL_ID = "gemma-3-270m"
BINARY = Path(".cache/llama-server/llama-server")
SLOTS, CTX_PER_SLOT = 8, 1024
SCENARIOS = ("concurrent", "single", "shared")
# a system prompt of about 900 tokens: with 16 more and 64 out it fits a 1,024-token slot
SHARED_PREFIX = 900


def start_kvgate(workdir: Path, args: argparse.Namespace) -> Process:
    config = toml_backend(
        "local",
        "local",
        MODEL_ID,
        n_ctx=SLOTS * CTX_PER_SLOT,
        n_parallel=SLOTS,
        n_threads=args.threads,
        n_batch=args.batch,
    )
    return start_gateway(workdir, "kvgate", config)


class LlamaServer:
    """llama-server on a free port; `url` once it answers /health."""

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "llama-server.log"
        flags = {
            "-m": default_model_path(),
            "-a": MODEL_ID,
            "--port": port,
            "-t": args.threads,
            "-tb": args.threads,
            "-np": SLOTS,
            "-c": SLOTS * CTX_PER_SLOT,
            "-b": args.batch,
            "-ub": args.batch,
            "-fa": "off",
        }
        argv = [str(args.binary), "--no-webui", *(str(x) for kv in flags.items() for x in kv)]
        self.proc = subprocess.Popen(argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        wait_http(self.url, self.proc, self.log)

    def stop(self) -> None:
        stop_process(self.proc)


def one_round(url: str, keys: list[str], pid: int, label: str, seed: int) -> dict[str, Run]:
    watch = {"server": pid}
    loads = {
        "concurrent": (random_requests(32, 64, 64, seed=seed), SLOTS),
        "single": (random_requests(8, 64, 64, seed=seed + 1), 1),
        "shared": (shared_prefix_requests(32, SHARED_PREFIX, 16, 64, seed=seed + 2), SLOTS),
    }
    return {
        name: measure(url, keys, MODEL_ID, reqs, c, f"{label} {name}", watch)
        for name, (reqs, c) in loads.items()
    }


def summarize(rounds: list[dict]) -> dict:
    """Per scenario: kvgate's figures over llama-server's, each round and the median."""
    out = {}
    for s in SCENARIOS:
        tput = [r["kvgate"][s].tokens_per_s / r["llama-server"][s].tokens_per_s for r in rounds]
        ttft = [r["kvgate"][s].ttft_p50_ms / r["llama-server"][s].ttft_p50_ms for r in rounds]
        out[s] = {
            "tokens_per_s_ratio": tput,
            "ttft_p50_ratio": ttft,
            "median_tokens_per_s_ratio": statistics.median(tput),
            "median_ttft_p50_ratio": statistics.median(ttft),
        }
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in (
        (axes[0], "tokens_per_s_ratio", "output tokens/s, kvgate / llama-server"),
        (axes[1], "ttft_p50_ratio", "TTFT p50, kvgate / llama-server (lower is better)"),
    ):
        for i, s in enumerate(SCENARIOS):
            values = summary[s][key]
            ax.scatter([i] * len(values), values, alpha=0.6)
            ax.hlines(statistics.median(values), i - 0.25, i + 0.25, color="black")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(SCENARIOS)), SCENARIOS)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--binary", type=Path, default=BINARY)
    ap.add_argument("--out", type=Path, default=Path("docs/perf/llama_server_anchor.json"))
    args = ap.parse_args(argv)
    if not args.binary.exists():
        raise SystemExit(f"{args.binary} is missing: run `make llama-server` first")
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-anchor-"))
    kvgate = start_kvgate(workdir, args)
    server = None
    try:
        server = LlamaServer(workdir, args)
        arms = {
            "kvgate": (kvgate.url, [tenant_key(kvgate.url)], kvgate.proc.pid),
            "llama-server": (server.url, [""], server.pid),
        }
        rounds = []
        for r in range(args.rounds):
            order = ["kvgate", "llama-server"] if r % 4 in (0, 3) else ["llama-server", "kvgate"]
            result = {}
            for name in order:
                url, keys, pid = arms[name]
                result[name] = one_round(url, keys, pid, name, seed=r)
                line = ", ".join(
                    f"{s} {run.tokens_per_s:.1f} tok/s TTFT p50 {run.ttft_p50_ms:.0f} ms"
                    for s, run in result[name].items()
                )
                print(f"round {r} {name}: {line}", flush=True)
            rounds.append(result)
        summary = summarize(rounds)
        print(
            json.dumps(
                {s: {k: v for k, v in d.items() if "median" in k} for s, d in summary.items()}
            )
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        raw = [
            {n: {s: _trim(run) for s, run in arm.items()} for n, arm in r.items()} for r in rounds
        ]
        args.out.write_text(json.dumps({"summary": summary, "rounds": raw}, indent=1) + "\n")
        plot(summary, args.out.with_suffix(".png"))
    finally:
        kvgate.stop()
        if server is not None:
            server.stop()
    return 0


def _trim(run: Run) -> dict:
    d = asdict(run)
    d.pop("ttfts_ms")
    return d


if __name__ == "__main__":
    raise SystemExit(main())
