"""kvgate's llama.cpp backend against llama-cpp-python's own server, in one run.

    python -m studies.local_vs_llama_server [--clients 8] [--max-tokens 64] [--threads 2]
                                          [--single-only]

Same GGUF (the default Gemma 3 270M), same threads and batch size, same machine; the
servers run one at a time so they never share the CPU. For each server: a warm-up request,
then `--clients` concurrent streaming greedy completions (distinct prompts, cold caches),
then each prompt alone for the full-text agreement check. llama_cpp.server runs twice:
with interrupt_requests off (it serializes) and with its default (on).

Single-stream speed: one streaming request through kvgate (after its concurrent run, so
its idle sequences hold cached cells, as in service), through the engine in this process
(its sequences filled the same way first), and through a bare in-process `Llama.create_completion(stream=True)`; `--repeats` rounds,
the order of the three rotating each round, each arm's tokens/s set against the bare
call's of the same round. The CPU time of kvgate's threads during its stream (from
/proc/<pid>/task/<tid>/schedstat) shows what the gateway itself costs per token,
independent of the other load on the machine. `--single-only` skips llama_cpp.server.

Output tokens are counted by tokenizing each response with the model's own vocabulary, the
same way for every server. Writes docs/perf/local.json and docs/perf/local.png
(docs/perf/local_single.json with --single-only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from backend_local.slots import common_prefix_len
from bench.client import RequestOutput, build_payload, send_request
from bench.options import DefaultsHelpFormatter
from engine_api.records import GenRequest
from studies.harness import (
    free_port,
    nearest_rank,
    start_gateway,
    stop_process,
    tenant_key,
    toml_backend,
    wait_http,
)

MODEL_ID = "gemma-3-270m"
PROMPTS = [
    "The history of the Roman Empire began when",
    "Here is a Python function that checks whether a number is prime:\n\ndef is_prime(n):",
    "The three most important things to remember when baking bread are",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "Photosynthesis is the process by which plants",
    "The main differences between TCP and UDP are",
    "To make a good cup of coffee, you should first",
    "The planets of the solar system, in order from the sun, are",
]
SINGLE_PROMPT = "Write a long story about a dragon who learns to sing. Once upon a time,"
# the arguments that local.json records as its "settings"
SETTINGS = ("clients", "max_tokens", "single_tokens", "threads", "batch", "ctx_per_seq", "repeats")


@dataclass
class RunReport:
    server: str
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    complete: int
    clients: int
    agree_with_solo: int  # responses equal to the same prompt sent alone
    agree_prefix_tokens: float  # mean length of the token prefix they share with it
    notes: list[str] = field(default_factory=list)


async def stream_completion(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, key: str | None
) -> RequestOutput:
    """One greedy streaming completion through `kvgate bench`'s client. No usage asked:
    llama_cpp.server's counts are not compared, every answer is tokenized alike."""
    payload = build_payload("completions", MODEL_ID, prompt, max_tokens, 0.0, ignore_eos=False)
    del payload["stream_options"]
    return await send_request(session, url, "completions", payload, key)


async def measure_server(
    name: str, url: str, keys: list[str | None], max_tokens: int, tokenize, clients: int
) -> RunReport:
    """keys: one for the concurrent run, one for the solo runs (on kvgate two tenants, so the
    solo runs compute their prompts afresh instead of reusing the concurrent run's cells)."""
    key, solo_key = keys
    prompts = PROMPTS[:clients]
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await stream_completion(session, url, "Hello, my name is", 8, key)  # warm-up
        start = time.perf_counter()
        batch = await asyncio.gather(
            *(stream_completion(session, url, p, max_tokens, key) for p in prompts)
        )
        wall = time.perf_counter() - start
        solo = [await stream_completion(session, url, p, max_tokens, solo_key) for p in prompts]
    tokens = [len(tokenize(r.generated_text)) for r in batch]
    complete = sum(
        not r.error
        and r.finish_reason in ("length", "stop")
        and (n == max_tokens or r.finish_reason == "stop")
        for r, n in zip(batch, tokens, strict=True)
    )
    notes = [f"client {i}: {r.error}" for i, r in enumerate(batch) if r.error]
    ttfts = [r.ttft for r in batch if r.generated_text]
    return RunReport(
        server=name,
        wall_s=wall,
        output_tokens=sum(tokens),
        tokens_per_s=sum(tokens) / wall,
        ttft_p50_s=nearest_rank(ttfts, 50) if ttfts else float("nan"),
        ttft_p99_s=nearest_rank(ttfts, 99) if ttfts else float("nan"),
        complete=complete,
        clients=clients,
        agree_with_solo=sum(
            b.generated_text == s.generated_text for b, s in zip(batch, solo, strict=True)
        ),
        agree_prefix_tokens=statistics.mean(
            common_prefix_len(tokenize(b.generated_text), tokenize(s.generated_text))
            for b, s in zip(batch, solo, strict=True)
        ),
        notes=notes,
    )


@contextlib.contextmanager
def kvgate_server(workdir: Path, args: argparse.Namespace):
    """kvgate on the local backend with the same settings as llama_cpp.server; its URL, a
    key for each of two tenants ("bench" for the concurrent run, "solo"), its pid."""
    config = toml_backend(
        "local",
        "local",
        MODEL_ID,
        n_ctx=args.clients * args.ctx_per_seq,
        n_parallel=args.clients,
        n_threads=args.threads,
        n_batch=args.batch,
    )
    with start_gateway(workdir, "kvgate", config) as gw:
        yield gw.url, [tenant_key(gw.url, name) for name in ("bench", "solo")], gw.proc.pid


@contextlib.contextmanager
def llama_cpp_server(workdir: Path, args: argparse.Namespace, model: str, interrupt: bool):
    port = free_port()
    log = workdir / f"llama_cpp_server_{port}.log"
    threads, batch = str(args.threads), str(args.batch)
    cmd = (
        [sys.executable, "-m", "llama_cpp.server", "--model", model, "--model_alias", MODEL_ID]
        + ["--n_ctx", str(args.ctx_per_seq), "--n_threads", threads, "--n_threads_batch", threads]
        + ["--n_batch", batch, "--n_ubatch", batch, "--logits_all", "False"]
        + ["--flash_attn", "False", "--interrupt_requests", str(interrupt), "--port", str(port)]
    )
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc, log)
        yield url
    finally:
        stop_process(proc)


def thread_cpu_ms(pid: int) -> dict[int, float]:
    """CPU time so far of each thread of process `pid`, in ms (Linux schedstat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            out[int(tid)] = int(f.read().split()[0]) / 1e6
    return out


def single_stream(args: argparse.Namespace, model: str, url: str, key: str, pid: int) -> dict:
    """Tokens/s of one streaming request: a bare Llama, the engine in this process (no HTTP),
    and kvgate over HTTP, in rotating order; per-round ratios to the bare call, medians."""
    from llama_cpp import Llama

    from backend_local import EngineConfig, LocalEngine, SamplingParams

    n_ctx = args.clients * args.ctx_per_seq
    config = EngineConfig(
        model, n_ctx=n_ctx, n_parallel=args.clients, n_batch=args.batch, n_threads=args.threads
    )
    engine = LocalEngine(config)

    options = dict(n_ctx=args.ctx_per_seq, n_threads=args.threads, n_threads_batch=args.threads)
    options |= dict(n_batch=args.batch, n_ubatch=args.batch, flash_attn=False)
    llama = Llama(model, **options, verbose=False)
    count = lambda text: len(llama.tokenize(text.encode(), add_bos=False))  # noqa: E731
    prompt = engine.tokenize(SINGLE_PROMPT)

    async def fill_engine() -> None:
        # like kvgate's sequences after its concurrent run: each holds a prompt and reply
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

        async def one(i: int, text: str) -> None:
            req = GenRequest(f"fill-{i}", "", engine.tokenize(text), params, cache_salt=f"f{i}")
            async for _ in engine.generate(req):
                pass

        await asyncio.gather(*(one(i, text) for i, text in enumerate(PROMPTS[: args.clients])))

    asyncio.run(fill_engine())
    cpu: dict[str, list[float]] = {"gateway_loop": [], "engine_thread": [], "client": []}

    # All three reuse the prompt from their previous round (Llama keeps its last tokens,
    # the engine and kvgate their cached cells), so every round after the first compares
    # decoding alone.
    def bare() -> tuple[float, str]:
        start, parts = time.perf_counter(), []
        for chunk in llama.create_completion(
            SINGLE_PROMPT, max_tokens=args.single_tokens, temperature=0.0, stream=True
        ):
            parts.append(chunk["choices"][0]["text"])
        return time.perf_counter() - start, "".join(parts)

    async def stream_kvgate() -> tuple[float, str]:
        async with aiohttp.ClientSession() as session:
            r = await stream_completion(session, url, SINGLE_PROMPT, args.single_tokens, key)
        assert not r.error, r.error
        return r.latency, r.generated_text

    def through_kvgate() -> tuple[float, str]:
        before, client_before = thread_cpu_ms(pid), time.thread_time()
        seconds, text = asyncio.run(stream_kvgate())
        client = (time.thread_time() - client_before) * 1000
        after = thread_cpu_ms(pid)
        used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
        tokens = count(text)
        cpu["gateway_loop"].append(used.pop(pid) / tokens)  # the main thread runs the loop
        cpu["engine_thread"].append(max(used.values()) / tokens)
        cpu["client"].append(client / tokens)
        return seconds, text

    async def stream_engine(round_: int) -> tuple[float, str]:
        start, parts = time.perf_counter(), []
        params = SamplingParams(temperature=0.0, max_tokens=args.single_tokens)
        req = GenRequest(f"single-{round_}", "", prompt, params, cache_salt="single")
        async for out in engine.generate(req):
            parts.append(out.text)
        return time.perf_counter() - start, "".join(parts)

    arms = {
        "bare": lambda _: bare(),
        "engine": lambda round_: asyncio.run(stream_engine(round_)),
        "kvgate": lambda _: through_kvgate(),
    }
    names = list(arms)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for round_ in tqdm(range(args.repeats), desc="single stream", unit="round"):
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            seconds, text = arms[name](round_)
            runs[name].append(count(text) / seconds)
    llama.close()
    engine.shutdown()
    result: dict = {f"{name}_tokens_per_s": statistics.median(r) for name, r in runs.items()}
    result["runs"] = runs
    for name in ("engine", "kvgate"):
        ratios = [a / b for a, b in zip(runs[name], runs["bare"], strict=True)]
        result[f"{name}_ratios"] = ratios
        result[f"{name}_ratio"] = statistics.median(ratios)
    result["cpu_ms_per_token"] = {name: statistics.median(v) for name, v in cpu.items()}
    return result


def plot(reports: list[RunReport], single: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = [r.server.replace(" (", "\n(") for r in reports]
    axes[0].bar(names, [r.tokens_per_s for r in reports], color="tab:blue")
    axes[0].set_title(f"{reports[0].clients} concurrent streams: output tokens/s")
    p50 = [r.ttft_p50_s for r in reports]
    p99_above_p50 = [r.ttft_p99_s - r.ttft_p50_s for r in reports]
    axes[1].bar(names, p50, label="p50")
    axes[1].bar(names, p99_above_p50, bottom=p50, alpha=0.5, label="p99")
    axes[1].set_title("TTFT (s)")
    axes[1].legend()
    rates = [single[f"{arm}_tokens_per_s"] for arm in ("bare", "engine", "kvgate")]
    axes[2].bar(["bare Llama", "engine (no HTTP)", "kvgate (HTTP)"], rates, color="tab:green")
    axes[2].set_title("single stream: tokens/s")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_single(single: dict, repeats: int) -> None:
    bare = single["bare_tokens_per_s"]
    print(f"\nsingle stream, medians of {repeats} rounds: bare Llama {bare:.1f} tok/s")
    for name in ("engine", "kvgate"):
        ratios = single[f"{name}_ratios"]
        print(
            f"  {name}: {single[f'{name}_tokens_per_s']:.1f} tok/s, "
            f"{single[f'{name}_ratio']:.3f}x bare (rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )
    cpu = single["cpu_ms_per_token"]
    print(
        f"  CPU per token during kvgate's stream: gateway event loop {cpu['gateway_loop']:.3f} ms,"
        f" engine thread {cpu['engine_thread']:.2f} ms, measuring client {cpu['client']:.3f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--ctx-per-seq", type=int, default=1024)
    parser.add_argument("--out", default="docs/perf")
    parser.add_argument(
        "--single-only",
        action="store_true",
        help="skip llama_cpp.server's runs (kvgate's concurrent run stays)",
    )
    args = parser.parse_args(argv)
    assert args.clients <= len(PROMPTS), f"at most {len(PROMPTS)} clients"

    from llama_cpp import Llama

    from gateway.backends.default_model import default_model_path

    model = str(default_model_path())
    vocab = Llama(model, vocab_only=True, verbose=False)
    tokenize = lambda text: vocab.tokenize(text.encode(), add_bos=False)  # noqa: E731
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        phases = tqdm(total=2 if args.single_only else 4, desc="servers", unit="phase")
        with kvgate_server(work, args) as (url, keys, pid):
            run = measure_server(
                "kvgate (local)", url, keys, args.max_tokens, tokenize, args.clients
            )
            reports.append(asyncio.run(run))
            phases.update()
            single = single_stream(args, model, url, keys[0], pid)
            phases.update()
        for interrupt in () if args.single_only else (False, True):
            with llama_cpp_server(work, args, model, interrupt) as url:
                name = f"llama_cpp.server (interrupt_requests={interrupt})"
                run = measure_server(
                    name, url, [None, None], args.max_tokens, tokenize, args.clients
                )
                reports.append(asyncio.run(run))
            phases.update()
        phases.close()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in SETTINGS}
    result = {"settings": settings, "model": model, "cpus": os.cpu_count()}
    result |= {"runs": [asdict(r) for r in reports], "single_stream": single}
    print_single(single, args.repeats)
    if args.single_only:
        (out / "local_single.json").write_text(json.dumps(result, indent=2))
        return 0
    (out / "local.json").write_text(json.dumps(result, indent=2))
    plot(reports, single, out / "local.png")

    base = reports[1].tokens_per_s
    print(
        "\n| server | output tok/s | vs llama_cpp.server | TTFT p50 | TTFT p99 | complete "
        "| = solo | tokens = solo |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in reports:
        print(
            f"| {r.server} | {r.tokens_per_s:.1f} | {r.tokens_per_s / base:.2f}x | "
            f"{r.ttft_p50_s:.2f} s | {r.ttft_p99_s:.2f} s | {r.complete}/{r.clients} | "
            f"{r.agree_with_solo}/{r.clients} | {r.agree_prefix_tokens:.1f} |"
        )
    for r in reports:
        for note in r.notes:
            print(f"{r.server}: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
