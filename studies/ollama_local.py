"""Issue 51's measurements, in one run: Ollama's API against the OpenAI one on the same
model, and a models directory's cold load against llama.cpp's own.

    python -m studies.ollama_local [--rounds 8] [--max-tokens 64] [--threads 2]
                                   [--loads 3] [--llama-server PATH]

One `kvgate serve --models-dir` over a directory of two GGUF files (the packaged SmolLM2
135M Instruct and Gemma 3 270M, linked in), --n-ctx N --n-parallel 1 (so the engine's
context holds 2N cells: its sequence and the fair queue's spare one).

1. Tokens/s: `/api/chat` against `/v1/chat/completions`, greedy, `--max-tokens`, the same
   messages, on SmolLM2 once it is loaded; whole and streamed (NDJSON against SSE), the
   arms alternating each round. Tokens/s is each arm's completion tokens (eval_count,
   usage.completion_tokens) over its requests' wall time, summed over the rounds.
2. Cold load: the first request of an unloaded model (`/api/generate` of one token,
   raw, after `keep_alive: 0` unloaded it), `--loads` times per model, its wall time and
   the `load_duration` it reports, against `llama_cpp.Llama(...)`'s construction on the
   same file, in this process, with the same context cells, threads and batch, while
   the gateway is idle. The file is read once before any timing: both are measured with
   the page cache warm, as a model's second and later loads are.

3. With `--llama-server PATH` (`make llama-server` builds .cache/llama-server/llama-server
   from the vendored llama.cpp): the same directory served by llama-server in router mode
   (studies/llama_server_router.py), up beside the gateway for the whole run: each model's
   cold first request (a one-token /v1/completions after `/models/unload`: the router
   starts the model's child process), its /v1/chat/completions whole and streamed as two
   more arms of 1., and whether it answers Ollama's /api/chat.

Ollama's own binary is not measured: none can be had from the package registries here
(PyPI's `ollama` is the client). Writes docs/perf/ollama_local.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.options import DefaultsHelpFormatter
from gateway.backends.default_model import INSTRUCT_MODEL_ID, default_model_path, model_path
from studies import llama_server_router
from studies.harness import ADMIN_KEY, Process, free_port, tenant_key

ASK = [{"role": "user", "content": "Tell me a long story about a dragon and a castle."}]
OUT = Path("docs/perf/ollama_local.json")


def main() -> None:
    # a study stopped by a signal still stops its servers (the with blocks unwind)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=8, help="requests per arm")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads, both sides")
    p.add_argument("--n-ctx", type=int, default=2048, help="context per sequence")
    p.add_argument("--loads", type=int, default=3, help="cold loads timed per model")
    p.add_argument("--llama-server", type=Path, help="llama-server to run in router mode too")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    files = {"smollm2": model_path(INSTRUCT_MODEL_ID), "gemma3": str(default_model_path())}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = work / "models"
        models.mkdir()
        for name, path in files.items():
            Path(path).read_bytes()  # the page cache warm for both sides
            os.symlink(path, models / f"{name}.gguf")
        report = measure(args, files, work, models)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def measure(args: argparse.Namespace, files: dict, work: Path, models: Path) -> dict:
    """Every figure of the run: kvgate's, llama.cpp's load and (with --llama-server) the
    router's, all servers up throughout."""
    flags = ["--models-dir", str(models), "--models-max", "2", "--n-parallel", "1"]
    flags += ["--n-ctx", str(args.n_ctx), "--n-threads", str(args.threads)]
    env = {"KVGATE_ADMIN_KEY": ADMIN_KEY, "KVGATE_DATABASE_URL": f"sqlite+aiosqlite:///{work}/g.db"}
    serve = ["serve", "--port", str(free_port()), *flags]
    with contextlib.ExitStack() as stack:
        gw = stack.enter_context(Process(work, "kvgate", serve, "kvgate: listening on ", env))
        auth = {"Authorization": f"Bearer {tenant_key(gw.url)}"}
        http = stack.enter_context(httpx.Client(base_url=gw.url, timeout=300, headers=auth))
        peer = None
        if args.llama_server is not None:
            # the same cells as kvgate's engine: its sequence and the fair queue's spare one
            router = llama_server_router.Router(
                args.llama_server, models, work, 2 * args.n_ctx, args.threads
            )
            stack.enter_context(router)
            # a connection each request: the router closed one that a streamed answer had
            # used, and the next request on it failed ("Server disconnected")
            fresh = httpx.Limits(max_keepalive_connections=0)
            peer = httpx.Client(base_url=router.url, timeout=300, limits=fresh)
            stack.enter_context(peer)
        say("cold loads through the gateway")
        loads = {name: cold_loads(http, name, args.loads) for name in files}
        say("llama_cpp.Llama(...) loads")
        library = {name: llama_loads(path, args) for name, path in files.items()}
        report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
        if peer is not None:
            say("cold loads through llama-server's router")
            report["llama_server"] = router_loads(peer, list(files), args.loads)
        say("tokens/s, /api/chat against /v1/chat/completions")
        report["throughput"] = throughput(http, peer, "smollm2", args.rounds, args.max_tokens)
    report["cold_load"] = {
        name: loads[name] | {"llama_cpp_Llama_s": library[name]} for name in files
    }
    for name in files:
        c = report["cold_load"][name]
        c["first_request_over_llama_load"] = c["first_request_s"] / c["llama_cpp_Llama_s"]
        if peer is not None:
            theirs = report["llama_server"]["first_request_s"][name]
            c["first_request_over_llama_server"] = c["first_request_s"] / theirs
    return report


def router_loads(peer: httpx.Client, names: list[str], n: int) -> dict:
    """llama-server's router: whether it has Ollama's /api/chat, and each model's cold
    first request (median of n)."""
    out: dict = {"api_chat_status": llama_server_router.api_chat_status(peer, names[0])}
    out["first_request_s"] = {
        name: statistics.median(
            llama_server_router.cold_first_request(peer, name) for _ in range(n)
        )
        for name in names
    }
    return out


def say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def cold_loads(http: httpx.Client, model: str, n: int) -> dict:
    """The first request of `model` unloaded, n times: its wall time and load_duration."""
    walls, loads = [], []
    for _ in range(n):
        http.post("/api/generate", json={"model": model, "keep_alive": 0}).raise_for_status()
        body = {"model": model, "prompt": "Hi", "raw": True, "stream": False}
        body |= {"options": {"num_predict": 1}, "keep_alive": 0}
        started = time.perf_counter()
        r = http.post("/api/generate", json=body)
        walls.append(time.perf_counter() - started)
        r.raise_for_status()
        loads.append(r.json()["load_duration"] / 1e9)
    return {
        "first_request_s": statistics.median(walls),
        "load_duration_s": statistics.median(loads),
    }


def llama_loads(path: str, args: argparse.Namespace) -> float:
    """llama.cpp's own load of the file: `Llama(...)` constructed, median of --loads."""
    import llama_cpp

    times = []
    for _ in range(args.loads):
        started = time.perf_counter()
        llama = llama_cpp.Llama(
            model_path=path, n_ctx=2 * args.n_ctx, n_threads=args.threads, verbose=False
        )
        times.append(time.perf_counter() - started)
        llama.close()
    return statistics.median(times)


def throughput(
    http: httpx.Client, peer: httpx.Client | None, model: str, rounds: int, max_tokens: int
) -> dict:
    """Tokens/s of each arm, the arms alternating each round; with `peer` (llama-server's
    router) its /v1/chat/completions too."""
    http.post("/api/generate", json={"model": model, "keep_alive": -1}).raise_for_status()
    arms = {
        "ollama_whole": lambda: ollama_chat(http, model, max_tokens, stream=False),
        "openai_whole": lambda: openai_chat(http, model, max_tokens, stream=False),
        "ollama_stream": lambda: ollama_chat(http, model, max_tokens, stream=True),
        "openai_stream": lambda: openai_chat(http, model, max_tokens, stream=True),
    }
    if peer is not None:
        peer.post("/models/load", json={"model": model})  # a 400 if it is loaded already
        arms["llama_server_whole"] = lambda: openai_chat(peer, model, max_tokens, stream=False)
        arms["llama_server_stream"] = lambda: openai_chat(peer, model, max_tokens, stream=True)
    for arm in arms.values():  # a warm-up each (the router's child loads in its first)
        arm()
    tokens = dict.fromkeys(arms, 0)
    seconds = dict.fromkeys(arms, 0.0)
    for i in range(rounds):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))
        for name in order:
            started = time.perf_counter()
            tokens[name] += arms[name]()
            seconds[name] += time.perf_counter() - started
    out: dict = {
        n: {"tokens": tokens[n], "s": seconds[n], "tok_s": tokens[n] / seconds[n]} for n in arms
    }
    for kind in ("whole", "stream"):
        out[f"ratio_{kind}"] = out[f"ollama_{kind}"]["tok_s"] / out[f"openai_{kind}"]["tok_s"]
        if peer is not None:
            theirs = out[f"llama_server_{kind}"]["tok_s"]
            out[f"ollama_over_llama_server_{kind}"] = out[f"ollama_{kind}"]["tok_s"] / theirs
            out[f"openai_over_llama_server_{kind}"] = out[f"openai_{kind}"]["tok_s"] / theirs
    return out


def ollama_chat(http: httpx.Client, model: str, max_tokens: int, stream: bool) -> int:
    options = {"num_predict": max_tokens, "temperature": 0}
    body = {"model": model, "messages": ASK, "stream": stream, "options": options}
    if not stream:
        r = http.post("/api/chat", json=body)
        r.raise_for_status()
        return r.json()["eval_count"]
    last = {}
    with http.stream("POST", "/api/chat", json=body) as r:
        for line in r.iter_lines():
            if line:
                last = json.loads(line)
    return last["eval_count"]


def openai_chat(http: httpx.Client, model: str, max_tokens: int, stream: bool) -> int:
    body = {"model": model, "messages": ASK, "max_tokens": max_tokens, "temperature": 0}
    if not stream:
        r = http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage = 0
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
    return usage


if __name__ == "__main__":
    main()
