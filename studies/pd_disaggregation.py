"""Issue 33's "prefill apart" benchmark: 8 decoding streams while long prompts arrive
every 2 s, on two `kvgate serve --workers 2` set-ups over the same two cores:

- both: two workers that each prefill and decode (today's scale-out);
- apart: `--prefill-workers 1`: one prefill worker and one decode worker; prompts of at
  least `--threshold` tokens are prefilled on the first and continued on the second,
  which pulls their KV blocks (gateway/serving/prefill_apart.py).

Each decoding stream sends a `--decode-prompt`-token prompt for `--decode-tokens`
output tokens, and the next as soon as it ends; a `--long-prompt`-token prompt (new
random tokens each time: nothing cached) for `--long-tokens` tokens arrives every
`--interval` s. Requests go through the gateway, streaming, greedy, ignore_eos.
Both gateways are up at once and the load alternates between them, `--rounds` times
each (the first set-up rotating), so the noise of a shared machine falls on both; each
round's figures are taken over its window after `--warmup` s, and pooled: the decoding
streams' TPOT per request (p50, p99) and their gaps between tokens (ITL p50, p99,
p99.9), the long prompts' TTFT, and the output tokens of every request per second. The
model is bench.tiny_model's random Llama at SHAPE (float32), where a 2,000-token prefill
takes about half a second on one core, so that one prefill worker keeps up with a prompt
every 2 s. `kvgate serve --workers 2` pins each worker to one core with one torch
thread (gateway/worker_pool/placement.py); the gateway runs unpinned on the same cores.

    .venv/bin/python -m studies.pd_disaggregation --out docs/perf/pd_disaggregation.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama, parameter_count
from studies.harness import Process, nearest_rank, start_gateway, tenant_key, toml_backend

VOCAB = 8192
SHAPE = {"hidden_size": 384, "num_layers": 6, "num_heads": 6, "num_kv_heads": 2}
SETUPS = ("both", "apart")


@dataclass
class Stream:
    """One streamed request: when it started and when each output chunk came."""

    kind: str  # "decode" | "long"
    start: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0  # completion tokens, as the usage says

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or len(self.chunks) < 2:
            return None
        return (self.chunks[-1] - self.chunks[0]) / (self.tokens - 1)


async def stream(http: aiohttp.ClientSession, url: str, key: str, kind: str, prompt, n: int):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    s = Stream(kind, time.perf_counter())
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("choices"):
                s.chunks.append(time.perf_counter())
            if event.get("usage"):
                s.tokens = event["usage"]["completion_tokens"]
    return s


async def load(
    url: str, key: str, args: argparse.Namespace, seed: int
) -> tuple[list[Stream], float]:
    """The decoding streams and the long prompts for warmup + duration seconds; the
    window's start. A round's prompts are its own (`seed`): none is cached from another."""
    rng = random.Random(seed)
    done: list[Stream] = []
    t0 = time.perf_counter()
    end = t0 + args.warmup + args.duration

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    async def decoding(http: aiohttp.ClientSession) -> None:
        while time.perf_counter() < end:
            prompt = tokens(args.decode_prompt)
            done.append(await stream(http, url, key, "decode", prompt, args.decode_tokens))

    async def long_prompts(http: aiohttp.ClientSession) -> None:
        sent = []
        while time.perf_counter() < end:
            prompt = tokens(args.long_prompt)
            sent.append(
                asyncio.create_task(stream(http, url, key, "long", prompt, args.long_tokens))
            )
            await asyncio.sleep(args.interval)
        done.extend(await asyncio.gather(*sent))

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await asyncio.gather(long_prompts(http), *(decoding(http) for _ in range(args.streams)))
    return done, t0 + args.warmup


def summarize(rounds: list[tuple[list[Stream], float]], duration: float) -> dict:
    """The figures of every round's window, pooled."""
    decode, longs, chunks = [], [], 0
    for done, start in rounds:
        end = start + duration
        decode += [
            s for s in done if s.kind == "decode" and start <= s.start <= s.chunks[-1] <= end
        ]
        longs += [s for s in done if s.kind == "long" and start <= s.start <= end]
        chunks += sum(1 for s in done for t in s.chunks if start <= t <= end)
    tpots = [t * 1000 for s in decode if (t := s.tpot) is not None]
    gaps = [(b - a) * 1000 for s in decode for a, b in zip(s.chunks, s.chunks[1:], strict=False)]
    ttfts = [(s.chunks[0] - s.start) * 1000 for s in longs if s.chunks]
    return {
        "decode_requests": len(decode),
        "tpot_p50_ms": round(nearest_rank(tpots, 50), 1),
        "tpot_p99_ms": round(nearest_rank(tpots, 99), 1),
        "itl_p50_ms": round(nearest_rank(gaps, 50), 1),
        "itl_p99_ms": round(nearest_rank(gaps, 99), 1),
        # a prefill stalls a few gaps in a thousand: p99 misses it, p99.9 does not
        "itl_p999_ms": round(nearest_rank(gaps, 99.9), 1),
        "long_requests": len(longs),
        "long_ttft_p50_ms": round(nearest_rank(ttfts, 50)),
        "long_ttft_p99_ms": round(nearest_rank(ttfts, 99)),
        "output_tokens_per_s": round(chunks / (duration * len(rounds)), 1),
    }


def start_setup(workdir: Path, model: str, setup: str, args: argparse.Namespace) -> Process:
    config = toml_backend(
        "tiny", "gpu", "tiny", model, device="cpu", dtype="float32", max_model_len=4096
    )
    flags = ["--workers", "2"]
    if setup == "apart":
        flags += ["--prefill-workers", "1", "--prefill-threshold", str(args.threshold)]
    return start_gateway(workdir, f"gateway-{setup}", config, *flags)


def run_setups(workdir: Path, model: str, setups: list[str], args: argparse.Namespace) -> dict:
    """Every set-up's gateway up at once; the load alternating between them."""
    gateways = {s: start_setup(workdir, model, s, args) for s in setups}
    rounds: dict[str, list] = {s: [] for s in setups}
    try:
        keys = {s: tenant_key(gw.url) for s, gw in gateways.items()}
        for r in range(args.rounds):
            for setup in setups[r % len(setups) :] + setups[: r % len(setups)]:
                print(f"round {r + 1}/{args.rounds}: {setup}", flush=True)
                done = asyncio.run(load(gateways[setup].url, keys[setup], args, seed=r))
                rounds[setup].append(done)
                print(f"  {summarize(rounds[setup][-1:], args.duration)}", flush=True)
    finally:
        for gw in gateways.values():
            gw.stop()
    return {s: summarize(rounds[s], args.duration) for s in setups}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    names = list(report["setups"])
    panels = [
        ("decoding streams: TPOT (ms)", ["tpot_p50_ms", "tpot_p99_ms"], ["p50", "p99"]),
        ("long prompts: TTFT (ms)", ["long_ttft_p50_ms", "long_ttft_p99_ms"], ["p50", "p99"]),
        ("output tokens/s, all requests", ["output_tokens_per_s"], ["tok/s"]),
    ]
    for ax, (title, keys, labels) in zip(axes, panels, strict=True):
        width = 0.8 / len(keys)
        for j, (k, label) in enumerate(zip(keys, labels, strict=True)):
            values = [report["setups"][n][k] for n in names]
            ax.bar([i + j * width for i in range(len(names))], values, width, label=label)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(names))], names)
        ax.set_title(title, fontsize=10)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(
        f"{report['streams']} decoding streams, a {report['long_prompt']}-token prompt every "
        f"{report['interval_s']:g} s; 2 workers on 2 cores",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--streams", type=int, default=8, help="decoding streams")
    p.add_argument("--decode-prompt", type=int, default=32, help="their prompts' tokens")
    p.add_argument("--decode-tokens", type=int, default=64, help="their output tokens")
    p.add_argument("--long-prompt", type=int, default=2000, help="the long prompts' tokens")
    p.add_argument("--long-tokens", type=int, default=16, help="their output tokens")
    p.add_argument("--interval", type=float, default=2.0, help="s between long prompts")
    p.add_argument("--threshold", type=int, default=1000, help="apart: --prefill-threshold")
    p.add_argument("--warmup", type=float, default=5.0, help="s before each round's window")
    p.add_argument("--duration", type=float, default=30.0, help="s of each round's window")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each set-up")
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated: both, apart")
    p.add_argument("--out", default="docs/perf/pd_disaggregation.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = str(build_tiny_llama(workdir / "model", **SHAPE, vocab_size=VOCAB))
        report = {
            "model_parameters": parameter_count(model),
            "streams": args.streams,
            "decode_prompt": args.decode_prompt,
            "decode_tokens": args.decode_tokens,
            "long_prompt": args.long_prompt,
            "long_tokens": args.long_tokens,
            "interval_s": args.interval,
            "threshold": args.threshold,
            "warmup_s": args.warmup,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "setups": run_setups(workdir, model, args.setups.split(","), args),
        }
    setups = report["setups"]
    if set(SETUPS) <= set(setups):
        both, apart = setups["both"], setups["apart"]
        report["tpot_p99_both_over_apart"] = round(both["tpot_p99_ms"] / apart["tpot_p99_ms"], 2)
        report["tokens_per_s_apart_over_both"] = round(
            apart["output_tokens_per_s"] / both["output_tokens_per_s"], 2
        )
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "setups"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
