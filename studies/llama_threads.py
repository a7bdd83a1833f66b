"""Why one 8-token request on the llama.cpp backend took 24 s beside other work (issue 50's
llama.cpp measurement): the engine's `n_threads` on a machine whose cores other jobs
share. Two engines on the default GGUF, `n_threads` 1 and 2 (our default is one a core,
up to 8: 2 here), one greedy request of `--max-tokens` tokens with `ignore_eos` at a time,
alternated between them in one process so that the machine's load falls on both alike.

llama.cpp's threads meet at a barrier after every op of the graph and spin there: while
another job holds a core, the thread on it is descheduled and the others wait for it,
each op. One thread has no barrier to wait at.

    .venv/bin/python -m studies.llama_threads --out docs/perf/llama_threads.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from backend_local.config import EngineConfig
from backend_local.engine import LocalEngine
from engine_api.records import GenRequest, SamplingParams
from gateway.backends.default_model import default_model_path

PROMPT = "<start_of_turn>user\nhello there<end_of_turn>\n<start_of_turn>model\n"


async def one(engine: LocalEngine, request_id: str, prompt: list[int], tokens: int) -> float:
    """Seconds for one request (its own cache salt: nothing reused from the last)."""
    sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    req = GenRequest(request_id, "m", prompt, sampling, cache_salt=request_id)
    start = time.perf_counter()
    async for _ in engine.generate(req):
        pass
    return time.perf_counter() - start


async def measure(args: argparse.Namespace) -> dict:
    path = str(default_model_path())
    threads = (1, 2)
    engines = {
        n: LocalEngine(EngineConfig(path, n_ctx=2048, n_parallel=3, n_threads=n)) for n in threads
    }
    try:
        prompt = engines[1].tokenize(PROMPT)
        times: dict[int, list[float]] = {n: [] for n in threads}
        for i in range(args.requests):
            for n in threads:
                times[n].append(await one(engines[n], f"r{i}-{n}", prompt, args.max_tokens))
    finally:
        for engine in engines.values():
            engine.shutdown()
    medians = {n: statistics.median(ts) for n, ts in times.items()}
    return {
        "seconds": {str(n): ts for n, ts in times.items()},
        "median_s": {str(n): m for n, m in medians.items()},
        "two_threads_vs_one": medians[2] / medians[1],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=6, help="requests on each engine")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    report = {"args": vars(args) | {"out": None}} | asyncio.run(measure(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
