"""Issue 50's measurement: batch work beside interactive requests on a backend of two
slots, all phases in one run against one gateway: `--backend fake` (behind the gateway's
fair queue, `max_in_flight = 2`), `gpu` (kvgate's engine, `max_num_seqs = 2`, on a random
Llama of bench.tiny_model: its scheduler preempts a batch line for an interactive request)
or `local` (llama.cpp on the default GGUF, `n_parallel = 2`, one thread).

- interactive median latency alone, beside a running batch, and beside the same lines
  sent as ordinary requests at full concurrency by another tenant (today's way);
- the batch's completion tokens/s with the server otherwise idle, against the same lines
  sent as ordinary requests at full concurrency.

The fake backend and llama.cpp have no priority scheduler: a line that holds a slot is
not preempted, so an interactive request waits at most for a slot to free, and shares
the steps of the lines already running (the gateway's queue serves it first and the
runner starts no line while one waits or runs there). On the gpu engine an interactive
request whose tenant has nothing running takes the scheduler's spare seat (VTC) and runs
beside both lines; any other gets a seat from a line, preempted (the JSON counts the
engine's preemptions in each phase).
The engines' answers are of fixed length (`ignore_eos`). `--rounds N` runs every phase N
times in turn and reports the medians, each ratio taken within its round: on a shared
machine a phase of a few seconds moves with the other jobs more than with the batch.
The gateway process's CPU (every thread, the engine's included) over the two idle
phases, a line, moves less with the other jobs: the batch's excess over ordinary
requests' is the runner's work a line and the polls (`gateway_cpu_ms_a_line`).

    .venv/bin/python -m studies.batch_yield --out docs/perf/batch_yield.json
    .venv/bin/python -m studies.batch_yield --backend gpu --lines 48 --interactive 20 --rounds 3 --out docs/perf/batch_yield_gpu_rounds1.json
    python3 -m studies.batch_yield --backend gpu --device cuda --dtype bfloat16 --hidden 2048 --layers 8 --heads 16 --kv-cache-mib 4096 --lines 48 --interactive 20
    .venv/bin/python -m studies.batch_yield --backend local --lines 40 --interactive 10 --max-tokens 8 --out docs/perf/batch_yield_local.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from studies.gateway_load import cpu_seconds
from studies.harness import admin, start_gateway, tenant_key, toml_backend

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}]}


def config(args: argparse.Namespace, tmp: Path) -> str:
    server = f"[server]\nbatch_in_flight = {args.batch_in_flight}\n\n"
    if args.backend == "gpu":
        return server + gpu_backend(args, tmp)
    if args.backend == "local":
        # one thread: llama.cpp's threads spin at each op's barrier, and beside other jobs
        # on a shared machine a second one made an 8-token request 6x slower (PERF.md)
        local = toml_backend("fake", "local", "fake", n_parallel=2, n_ctx=2048, n_threads=1)
        return server + local
    fake = toml_backend(
        "fake", "fake", "fake", max_in_flight=2, ttft_ms=args.ttft_ms,
        tokens_per_second=args.tokens_per_second,
    )  # fmt: skip
    return server + fake


def gpu_backend(args: argparse.Namespace, tmp: Path) -> str:
    """The gpu engine's entry: bench.tiny_model's random Llama (its default shape, or the
    one asked for), on the device and in the dtype asked for (the engine's "auto": CUDA
    when torch sees a GPU), with a KV cache of `--kv-cache-mib` where given."""
    from bench.tiny_model import build_tiny_llama

    shape = {}
    if args.hidden:
        shape = {"hidden_size": args.hidden, "num_layers": args.layers}
        shape |= {"num_heads": args.heads, "num_kv_heads": max(1, args.heads // 2)}
        shape |= {"vocab_size": args.vocab}
    model = str(build_tiny_llama(tmp / "model", **shape))
    options: dict = {"max_num_seqs": 2, "device": args.device, "dtype": args.dtype}
    if args.kv_cache_mib:
        options["kv_cache_memory_bytes"] = args.kv_cache_mib << 20
    return toml_backend("fake", "gpu", "fake", model, **options)


async def one(http: httpx.AsyncClient, key: str, max_tokens: int) -> tuple[float, int]:
    """A chat request's latency (s) and completion tokens."""
    start = time.perf_counter()
    r = await http.post(
        "/v1/chat/completions",
        json=CHAT | {"max_tokens": max_tokens},
        headers={"Authorization": f"Bearer {key}"},
    )
    r.raise_for_status()
    return time.perf_counter() - start, r.json()["usage"]["completion_tokens"]


async def interactive(http: httpx.AsyncClient, key: str, args: argparse.Namespace) -> float:
    """The median latency of `--interactive` requests sent one after another."""
    times = [(await one(http, key, args.max_tokens))[0] for _ in range(args.interactive)]
    return statistics.median(times)


async def submit_batch(http: httpx.AsyncClient, key: str, args: argparse.Namespace) -> str:
    auth = {"Authorization": f"Bearer {key}"}
    lines = [
        {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": CHAT | {"max_tokens": args.max_tokens}}
        for i in range(args.lines)
    ]  # fmt: skip
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = await http.post(
        "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}, headers=auth
    )
    f.raise_for_status()
    body = {"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions"}
    b = await http.post("/v1/batches", json=body | {"completion_window": "24h"}, headers=auth)
    b.raise_for_status()
    return b.json()["id"]


async def batch_done(http: httpx.AsyncClient, key: str, batch_id: str) -> dict:
    """The batch once ended. Polled after half the time its rest would take at its pace
    so far, between 10 and 250 ms: each poll is the gateway's work during the phase (a
    poll every 50 ms was about one a line), and the phase ends at the poll that sees the
    end, at most 10 ms late (50 before)."""
    start = time.perf_counter()
    while True:
        r = await http.get(f"/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"})
        batch = r.json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        counts = batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        pace = (time.perf_counter() - start) / done if done else 0.05  # s a line
        await asyncio.sleep(min(0.25, max(0.01, 0.5 * (counts["total"] - done) * pace)))


async def ordinary(http: httpx.AsyncClient, key: str, args: argparse.Namespace) -> list:
    return await asyncio.gather(*(one(http, key, args.max_tokens) for _ in range(args.lines)))


def preemptions(url: str) -> int:
    """The engines' preemptions so far (a backend that preempts nothing counts 0)."""
    return sum(b["preemptions"] for b in admin(url, "GET", "/admin/backends")["data"])


async def phases(url: str, pid: int, args: argparse.Namespace) -> dict:
    """Every phase, `--rounds` times in turn; with more than one round, the medians of its
    figures (ratios taken within each round), the rounds' competition all through, the
    preemptions summed, and each round under `rounds`."""
    fg = tenant_key(url, "interactive")
    limits = httpx.Limits(max_connections=args.lines + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await interactive(http, fg, args)  # warm-up
        rounds = [await one_round(http, url, pid, fg, args, f"-{r}") for r in range(args.rounds)]
    if len(rounds) == 1:
        return rounds[0]
    return merged(rounds) | {"rounds": rounds}


def merged(rounds: list[dict]) -> dict:
    out: dict = {}
    for key, first in rounds[0].items():
        values = [r[key] for r in rounds]
        if isinstance(first, dict):
            out[key] = merged(values)
        elif isinstance(first, bool):
            out[key] = all(values)
        elif isinstance(first, int):
            out[key] = sum(values)
        else:
            out[key] = statistics.median(values)
    return out


async def one_round(
    http: httpx.AsyncClient, url: str, pid: int, fg: str, args: argparse.Namespace, tag: str
) -> dict:
    """The phases once, against tenants of their own (named with `tag`) but `fg`'s;
    `pid` is the gateway's process."""
    alone = await interactive(http, fg, args)
    # the batch's throughput, the server otherwise idle
    bg = tenant_key(url, "batch-idle" + tag)
    start, cpu = time.perf_counter(), cpu_seconds(pid)
    done = await batch_done(http, bg, await submit_batch(http, bg, args))
    batch_s, batch_cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    assert done["request_counts"]["completed"] == args.lines, done
    # the same lines as ordinary requests at full concurrency
    start, cpu = time.perf_counter(), cpu_seconds(pid)
    answers = await ordinary(http, tenant_key(url, "ordinary-idle" + tag), args)
    ordinary_s, ordinary_cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    tokens = sum(n for _, n in answers)
    # interactive beside a running batch
    bg = tenant_key(url, "batch-beside" + tag)
    before = preemptions(url)
    batch_id = await submit_batch(http, bg, args)
    beside_batch = await interactive(http, fg, args)
    # whether the batch still ran when the last interactive request ended
    auth = {"Authorization": f"Bearer {bg}"}
    batch_throughout = (await http.get(f"/v1/batches/{batch_id}", headers=auth)).json()
    await batch_done(http, bg, batch_id)
    preempted = {"beside_batch": preemptions(url) - before}
    before = preemptions(url)
    # interactive beside the same lines as ordinary requests
    flood = asyncio.ensure_future(ordinary(http, tenant_key(url, "ordinary-beside" + tag), args))
    await asyncio.sleep(0.05)
    beside_ordinary = await interactive(http, fg, args)
    flood_throughout = not flood.done()
    await flood
    preempted["beside_ordinary"] = preemptions(url) - before
    return {
        "interactive_median_s": {
            "alone": alone, "beside_batch": beside_batch, "beside_ordinary": beside_ordinary,
        },
        "competition_throughout": {
            "batch": batch_throughout["status"] == "in_progress",
            "ordinary": flood_throughout,
        },
        # the engine's preemptions over each phase: under VTC an interactive request of a
        # tenant with nothing running takes its spare seat and displaces no line
        "preemptions": preempted,
        "beside_batch_vs_alone": beside_batch / alone,
        "beside_ordinary_vs_alone": beside_ordinary / alone,
        "batch_tokens_per_s": tokens / batch_s,
        "ordinary_tokens_per_s": tokens / ordinary_s,
        "batch_vs_ordinary_tokens_per_s": ordinary_s / batch_s,
        "gateway_cpu_ms_a_line": {
            "batch": 1000 * batch_cpu / args.lines, "ordinary": 1000 * ordinary_cpu / args.lines,
        },
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=160, help="lines in the batch")
    p.add_argument("--interactive", type=int, default=30, help="interactive requests a phase")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1, help="every phase this many times, in turn")
    p.add_argument("--ttft-ms", type=int, default=20)
    p.add_argument("--tokens-per-second", type=float, default=400)
    p.add_argument("--batch-in-flight", type=int, default=4)
    p.add_argument("--backend", choices=("fake", "gpu", "local"), default="fake")
    gpu = p.add_argument_group("--backend gpu: the engine and its random Llama")
    gpu.add_argument("--device", default="auto", help="auto: CUDA when torch sees a GPU")
    gpu.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, else float32")
    gpu.add_argument("--hidden", type=int, default=0, help="0: bench.tiny_model's shape")
    gpu.add_argument("--layers", type=int, default=8)
    gpu.add_argument("--heads", type=int, default=16)
    gpu.add_argument("--vocab", type=int, default=32000)
    gpu.add_argument("--kv-cache-mib", type=int, default=0, help="0: the engine's default")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.backend != "fake":
        CHAT["ignore_eos"] = True  # every answer max_tokens long, lines and interactive
    with (
        tempfile.TemporaryDirectory() as tmp,
        start_gateway(Path(tmp), "batch-yield", config(args, Path(tmp))) as gw,
    ):
        report = {"args": vars(args) | {"out": None}} | asyncio.run(
            phases(gw.url, gw.proc.pid, args)
        )
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
