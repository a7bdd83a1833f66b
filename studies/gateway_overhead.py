"""The gateway alone: requests/s and added latency over calling the fake backend directly.

    python -m studies.gateway_overhead [--duration 10] [--rate 1000] [--out docs/perf]
    python -m studies.gateway_overhead --before REV [--after REV] [--duration 20]

Starts two servers, each one process pinned to CPU 0, and drives them from CPU 1:
- kvgate: `kvgate serve --backend fake` with auth, quota (a tenant with limits) and
  group-committed usage rows on SQLite;
- direct: a bare aiohttp handler that calls the same FakeBackend and returns the same
  JSON, with no auth, quota or usage.
Throughput comes from wrk (closed loop, 64 connections) when it is installed, else from
an aiohttp client; latency from an open-loop aiohttp client at a fixed request rate.

With --before, it compares the gateway at REV with this tree's instead
(studies.gateway_before: chat and text completions, whole and streamed, at each
--conns, runs in the order before, after, after, before) and writes
gateway_before.json and gateway_before.png. With --parsers REASONING,TOOLS, the gateway
with those output parsers on against none (studies.gateway_parsers), gateway_parsers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.options import DefaultsHelpFormatter
from studies import gateway_before, gateway_parsers
from studies.gateway_load import (
    start_kvgate,
    start_server,
    wait_up,
    wrk,
    wrk_percentile_ms,
    wrk_rps,
)
from studies.harness import free_port

HELLO = {"role": "user", "content": "hello there"}
BODY = {"model": "fake-model", "messages": [HELLO], "max_tokens": 16}


def start_direct(port: int) -> subprocess.Popen:
    proc = start_server(["studies.gateway_overhead", "--direct-server", str(port)])
    wait_up(f"http://127.0.0.1:{port}")
    return proc


def run_direct_server(port: int) -> None:
    """The baseline: the fake backend behind one aiohttp handler, nothing else."""
    from aiohttp import web

    from gateway.backends import BackendSpec, GenRequest, SamplingParams
    from gateway.backends.fake import FakeBackend

    fake = FakeBackend(BackendSpec("fake", "fake", "", "fake-model"))

    async def chat(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        ids = await fake.render(body["model"], body["messages"])
        sampling = SamplingParams(max_tokens=body["max_tokens"])
        req = GenRequest(os.urandom(12).hex(), body["model"], ids, sampling)
        text, n = [], 0
        async for chunk in fake.generate(req):
            text.append(chunk.text)
            n += len(chunk.token_ids)
        message = {"role": "assistant", "content": "".join(text)}
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
        completion = {
            "id": req.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
            "usage": usage,
        }
        return web.json_response(completion)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def main() -> None:
        await fake.start()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def wrk_throughput(url: str, key: str, duration: int, tmp: Path) -> float:
    return wrk_rps(wrk(url, key, duration, tmp, conns=64))


def wrk_paced(url: str, key: str, rate: float, duration: int, tmp: Path) -> dict:
    """About `rate` requests/s from 32 connections, each pausing 32/rate s between its
    requests; wrk's latency percentiles and the rate it actually reached."""
    conns = 32
    out = wrk(url, key, duration, tmp, conns, delay_ms=1000 * conns / rate)
    p50, p99 = wrk_percentile_ms(out, "50"), wrk_percentile_ms(out, "99")
    return {"p50_ms": p50, "p99_ms": p99, "achieved_rps": wrk_rps(out)}


async def closed_loop(url: str, key: str, duration: float, conns: int = 64) -> float:
    """Requests/s of `conns` connections each sending its next request when the last one
    is answered."""
    headers = {"Authorization": f"Bearer {key}"}
    done = 0
    end = time.perf_counter() + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns)) as http:

        async def worker():
            nonlocal done
            while time.perf_counter() < end:
                async with http.post(url + "/v1/chat/completions", json=BODY, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                done += 1

        await asyncio.gather(*(worker() for _ in range(conns)))
    return done / duration


async def _open_loop(url: str, key: str, rate: float, duration: float) -> list[float]:
    """Requests sent on a fixed schedule, whatever the server does: latency under load."""
    headers = {"Authorization": f"Bearer {key}"}
    latencies: list[float] = []
    # A bounded pool, and latency counted from the scheduled send time: a request
    # that waits for a connection is late, and the wait is part of its latency.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as http:

        async def one(at: float) -> None:
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            t0 = at
            async with http.post(url + "/v1/chat/completions", json=BODY, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
            latencies.append(time.perf_counter() - t0)

        start = time.perf_counter() + 0.5
        n = int(rate * duration)
        await asyncio.gather(*(one(start + i / rate) for i in range(n)))
    return latencies


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def measure(url: str, key: str, args: argparse.Namespace, tmp: Path) -> dict:
    # warm up both the server and the connection pool
    asyncio.run(closed_loop(url, key, 2))
    if shutil.which("wrk"):
        rps = wrk_throughput(url, key, args.duration, tmp)
        paced = wrk_paced(url, key, args.rate, args.duration, tmp)
        return {"rps": rps, "tool": "wrk -t1 (-c64 closed loop; -c32 paced)"} | paced
    rps = asyncio.run(closed_loop(url, key, args.duration))
    lat = asyncio.run(_open_loop(url, key, args.rate, args.duration))
    open_loop = {"p50_ms": 1000 * _pct(lat, 50), "p99_ms": 1000 * _pct(lat, 99)}
    open_loop["achieved_rps"] = len(lat) / args.duration
    return {"rps": rps, "tool": "aiohttp (64 connections; open loop)"} | open_loop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--duration", type=int, default=10)
    p.add_argument("--rate", type=float, default=1000)
    p.add_argument("--out", default="docs/perf")
    p.add_argument("--direct-server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--before", help="compare the gateway at this commit with this tree's")
    p.add_argument("--after", help="with --before: this commit's gateway, not this tree's")
    p.add_argument("--rounds", type=int, default=1, help="with --before: rounds of A B B A")
    p.add_argument("--apis", type=_names, default=list(gateway_before.APIS))
    p.add_argument("--modes", type=_names, default=list(gateway_before.MODES))
    p.add_argument("--conns", type=_names, default=[1, 32], help="wrk connections per case")
    p.add_argument("--parsers", help="REASONING,TOOLS: the gateway with these parsers on, not")
    args = p.parse_args(argv)
    if args.direct_server:
        run_direct_server(args.direct_server)
        return 0
    if args.before:
        return _compare(args)
    if args.parsers:
        result = gateway_parsers.compare(args)
        print(json.dumps(result["summary"], indent=2))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gateway_parsers.json").write_text(json.dumps(result, indent=2))
        return 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        direct = start_direct(free_port())
        try:
            print("measuring the fake backend directly ...", flush=True)
            base = measure(f"http://127.0.0.1:{direct.args[-1]}", "none", args, tmp)
        finally:
            direct.terminate()
            direct.wait()
        port = free_port()
        gw, key = start_kvgate(port, tmp)
        try:
            print("measuring kvgate (auth + quota + usage commit) ...", flush=True)
            kv = measure(f"http://127.0.0.1:{port}", key, args, tmp)
        finally:
            gw.terminate()
            gw.wait()
    result = {"direct": base, "kvgate": kv, "rate": args.rate, "duration_s": args.duration}
    for key in ("p50_ms", "p99_ms"):
        result[f"added_{key}"] = kv[key] - base[key]
    result["rps_ratio"] = kv["rps"] / base["rps"]
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway_overhead.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "gateway_overhead.png")
    return 0


def _names(text: str) -> list:
    """A comma-separated list (of ints where they are)."""
    return [int(x) if x.isdigit() else x for x in text.split(",")]


def _compare(args: argparse.Namespace) -> int:
    result = gateway_before.compare(args)
    print(json.dumps(result["summary"], indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway_before.json").write_text(json.dumps(result, indent=2))
    gateway_before.plot(result, out / "gateway_before.png")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, colors = ["direct (fake backend)", "kvgate"], ["#999999", "#1f77b4"]
    runs = [result["direct"], result["kvgate"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [r["rps"] for r in runs], color=colors)
    left.axhline(2000, color="red", linestyle="--", label="goal: 2,000 req/s")
    left.set_title("non-streaming requests/s (wrk, 64 connections)")
    left.legend()
    x = range(2)
    for offset, key, alpha in ((-0.2, "p50_ms", 0.6), (0.2, "p99_ms", 1.0)):
        xs = [i + offset for i in x]
        right.bar(xs, [r[key] for r in runs], width=0.4, label=key.split("_")[0], alpha=alpha)
    right.set_xticks(list(x), names)
    right.set_ylabel("ms")
    right.set_title(f"latency at a paced {result['rate']:.0f} req/s offered")
    right.legend()
    fig.suptitle("The gateway alone: auth + quota + usage commit over the fake backend")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
