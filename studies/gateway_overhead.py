"""The gateway alone: requests/s and added latency over calling the fake backend directly.

    python -m studies.gateway_overhead [--duration 10] [--rate 1000] [--out docs/perf]

Starts two servers, each one process pinned to CPU 0, and drives them from CPU 1:
- kvgate: `kvgate serve --backend fake` with auth, quota (a tenant with limits) and
  group-committed usage rows on SQLite;
- direct: a bare aiohttp handler that calls the same FakeBackend and returns the same
  JSON, with no auth, quota or usage.
Throughput comes from wrk (closed loop, 64 connections) when it is installed, else from
an aiohttp client; latency from an open-loop aiohttp client at a fixed request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from bench.options import DefaultsHelpFormatter
from studies.harness import ADMIN_KEY, free_port, tenant_key

HELLO = {"role": "user", "content": "hello there"}
BODY = {"model": "fake-model", "messages": [HELLO], "max_tokens": 16}


def _pinned(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() > 1 else []


def _start_server(
    module_args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """`python -m <module_args>` pinned to CPU 0 (the load comes from CPU 1), output dropped;
    from the source tree `cwd` when given (its modules come before the installed ones)."""
    cmd = [*_pinned(0), sys.executable, "-m", *module_args]
    return subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _wait_up(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def start_kvgate(
    port: int, tmp: Path, env: dict[str, str] | None = None, source: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """`kvgate serve --backend fake` on `port` (with `env` over the environment; from the
    source tree `source`, another commit's checkout, when given) and a tenant's key."""
    database_url = f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
    env = os.environ | (env or {}) | {"KVGATE_ADMIN_KEY": ADMIN_KEY}
    env["KVGATE_DATABASE_URL"] = database_url
    args = ["gateway.cli", "serve", "--backend", "fake", "--port", str(port)]
    proc = _start_server(args, env, source)
    url = f"http://127.0.0.1:{port}"
    _wait_up(url)
    return proc, tenant_key(url)


def start_direct(port: int) -> subprocess.Popen:
    proc = _start_server(["studies.gateway_overhead", "--direct-server", str(port)])
    _wait_up(f"http://127.0.0.1:{port}")
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


def _wrk(url: str, key: str, duration: int, tmp: Path, conns: int, delay_ms: float = 0) -> str:
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(BODY))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
        # each connection waits this long between requests: a paced, fixed offered rate
        + (f"function delay() return {delay_ms} end\n" if delay_ms else "")
    )
    flags = ["-t1", f"-c{conns}", f"-d{duration}s", "--latency", "-s", str(script)]
    cmd = [*_pinned(1), "wrk", *flags, url + "/v1/chat/completions"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non2xx:
        raise RuntimeError(f"wrk saw {non2xx.group(1)} failed responses:\n{out}")
    return out


def wrk_throughput(url: str, key: str, duration: int, tmp: Path) -> float:
    out = _wrk(url, key, duration, tmp, conns=64)
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


def wrk_paced(url: str, key: str, rate: float, duration: int, tmp: Path) -> dict:
    """About `rate` requests/s from 32 connections, each pausing 32/rate s between its
    requests; wrk's latency percentiles and the rate it actually reached."""
    conns = 32
    out = _wrk(url, key, duration, tmp, conns, delay_ms=1000 * conns / rate)
    units = {"us": 0.001, "ms": 1.0, "s": 1000.0}

    def pct(p: str) -> float:
        value, unit = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        return float(value) * units[unit]

    achieved = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    return {"p50_ms": pct("50"), "p99_ms": pct("99"), "achieved_rps": achieved}


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
    args = p.parse_args(argv)
    if args.direct_server:
        run_direct_server(args.direct_server)
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
