"""`kvgate bench serve`: drive an OpenAI-compatible server with a workload and measure it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import aiohttp
import numpy as np
from tqdm import tqdm

from bench.client import RequestOutput, build_payload, send_request
from bench.datasets import SampleRequest
from bench.metrics import compute_metrics, format_report, metrics_to_dict


@dataclass
class ServeConfig:
    url: str
    model: str | None
    api_keys: list[str]
    endpoint: str = "completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_tenants: int = 1
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0
    percentile_metrics: list[str] = field(default_factory=lambda: ["ttft", "tpot", "itl", "e2el"])
    metric_percentiles: list[float] = field(default_factory=lambda: [99.0])
    goodput: dict[str, float] = field(default_factory=dict)
    show_progress: bool = True
    # called with each finished request; True stops the run there (`kvgate tune` stops a
    # candidate whose goals are already lost): nothing more is sent, and what is in
    # flight is cancelled and left out of the result
    abort_when: Callable[[RequestOutput], bool] | None = None
    # seconds after the run's start past which no request starts (`kvgate tune`'s share
    # of its budget per candidate): those in flight finish and count, the rest are left out
    send_for_s: float | None = None
    # seconds after the run's start at which it stops as abort_when stops it (the end of
    # that share); the result's cut_in_flight counts the requests it cut
    abort_after_s: float | None = None


def arrival_times(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send offsets (s) of n requests: gaps drawn from a gamma distribution with mean
    1/rate and shape `burstiness` (1: a Poisson process; <1 burstier; >1 steadier).
    An infinite rate sends everything at once. The first request goes at 0."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if math.isinf(request_rate) or n == 0:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def tenant_keys(api_keys: Sequence[str], num_tenants: int) -> list[str | None]:
    """One API key per tenant; requests go round-robin over tenants."""
    if num_tenants < 1:
        raise ValueError(f"--num-tenants must be >= 1, got {num_tenants}")
    if not api_keys:
        if num_tenants > 1:
            raise ValueError(f"--num-tenants {num_tenants} needs {num_tenants} API keys")
        return [None]
    if len(api_keys) < num_tenants:
        raise ValueError(
            f"--num-tenants {num_tenants} needs {num_tenants} API keys, got {len(api_keys)}"
        )
    return list(api_keys[:num_tenants])


def normalize_url(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1")


async def first_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(base_url + "/v1/models", headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models: HTTP {response.status}")
        models = (await response.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url} serves no models")
    return models[0]["id"]


async def run_requests(
    cfg: ServeConfig, requests: Sequence[SampleRequest]
) -> tuple[list[RequestOutput], float, str, int]:
    """Send every request on its arrival schedule; returns outputs, duration, model and
    how many requests were cut in flight (the run stopped before they finished)."""
    base_url = normalize_url(cfg.url)
    keys = tenant_keys(cfg.api_keys, cfg.num_tenants)
    offsets = arrival_times(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = cfg.model or await first_model(session, base_url, keys[0])
        progress = tqdm(total=len(requests), disable=not cfg.show_progress, desc="requests")

        def too_late() -> bool:
            return cfg.send_for_s is not None and time.perf_counter() - start >= cfg.send_for_s

        async def one(i: int, req: SampleRequest) -> RequestOutput | None:
            tenant = (i if req.tenant is None else req.tenant) % len(keys)
            payload = build_payload(
                cfg.endpoint, model, req.prompt, req.max_tokens, cfg.temperature, cfg.ignore_eos
            )
            nonlocal in_flight
            async with limit or contextlib.nullcontext():
                if too_late():  # waited for a seat past the time to send
                    return None
                in_flight += 1
                out = await send_request(
                    session, base_url, cfg.endpoint, payload, keys[tenant], tenant
                )
                in_flight -= 1
            progress.update(1)
            if cfg.abort_when is not None and cfg.abort_when(out):
                stop.set()
            return out

        stop = asyncio.Event()
        start = time.perf_counter()
        in_flight = 0
        if cfg.abort_after_s is not None:
            timer = asyncio.get_running_loop().call_later(cfg.abort_after_s, stop.set)
        tasks = []
        for i, (req, offset) in enumerate(zip(requests, offsets, strict=True)):
            if cfg.send_for_s is not None and offset >= cfg.send_for_s:
                break  # due after the time to send: not waited for
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if stop.is_set() or too_late():
                break
            tasks.append(asyncio.create_task(one(i, req)))
        outputs = [out for out in await until_stopped(tasks, stop) if out is not None]
        duration = time.perf_counter() - start
        if cfg.abort_after_s is not None:
            timer.cancel()
        progress.close()
    return outputs, duration, model, in_flight


async def until_stopped(
    tasks: list[asyncio.Task], stop: asyncio.Event
) -> list[RequestOutput | None]:
    """Every task's output, or, if `stop` is set first, those that finished by then
    (the rest cancelled)."""
    everything = asyncio.gather(*tasks)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({everything, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if everything.done():
        return everything.result()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(asyncio.CancelledError):
        await everything  # cancelled with its tasks: taken, so asyncio does not warn
    return [t.result() for t in tasks if not t.cancelled() and t.exception() is None]


def per_tenant(outputs: Sequence[RequestOutput], num_tenants: int) -> list[dict]:
    rows = []
    for tenant in range(num_tenants):
        mine = [o for o in outputs if o.tenant == tenant]
        ok = [o for o in mine if o.success]
        rows.append(
            {
                "tenant": tenant,
                "completed": len(ok),
                "failed": len(mine) - len(ok),
                "output_tokens": sum(o.output_tokens or 0 for o in ok),
                "mean_ttft_ms": float(np.mean([o.ttft for o in ok]) * 1000) if ok else 0.0,
            }
        )
    return rows


def build_result(
    cfg: ServeConfig,
    requests: Sequence[SampleRequest],
    outputs: Sequence[RequestOutput],
    duration: float,
    model: str,
    extra: dict,
) -> tuple[dict, str]:
    """The JSON result (config, metrics, per-request series) and the printed block."""
    metrics = compute_metrics(outputs, duration, cfg.metric_percentiles, cfg.goodput or None)
    header: dict[str, object] = {}
    if cfg.max_concurrency:
        header["Maximum request concurrency:"] = cfg.max_concurrency
    if not math.isinf(cfg.request_rate):
        header["Request rate configured (RPS):"] = float(cfg.request_rate)
    if cfg.num_tenants > 1:
        header["Tenants:"] = cfg.num_tenants
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "url": normalize_url(cfg.url),
        "model": model,
        "endpoint": cfg.endpoint,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "num_tenants": cfg.num_tenants,
        "seed": cfg.seed,
        "goodput_slos_ms": cfg.goodput or None,
        **extra,
        **metrics_to_dict(metrics, cfg.percentile_metrics),
        "per_tenant": per_tenant(outputs, cfg.num_tenants),
        "input_lens": [o.prompt_tokens for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "errors": [o.error for o in outputs],
    }
    return result, format_report(metrics, cfg.percentile_metrics, header)


def serve_benchmark(
    cfg: ServeConfig, requests: Sequence[SampleRequest], extra: dict | None = None
) -> tuple[dict, str]:
    outputs, duration, model, cut = asyncio.run(run_requests(cfg, requests))
    return build_result(
        cfg, requests, outputs, duration, model, {"cut_in_flight": cut} | (extra or {})
    )


def plot_requests(result: dict, path: str) -> None:
    """Each request's TTFT and end-to-end latency against when it was sent, as a PNG:
    the summary's percentiles hide whether latency grew as a queue built up, came from
    a warm-up, or from one slow stretch; this shows which."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    starts, errors = result["start_times"], result["errors"]
    t0 = min(starts, default=0.0)
    ok = [i for i, error in enumerate(errors) if not error]
    sent = [starts[i] - t0 for i in ok]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    if ok:
        ax.plot(sent, [result["latencies"][i] * 1000 for i in ok], "x", label="end-to-end latency")
        ax.plot(sent, [result["ttfts"][i] * 1000 for i in ok], "o", ms=4, label="TTFT")
    failed = [starts[i] - t0 for i, error in enumerate(errors) if error]
    if failed:  # on the time axis, so a burst of errors shows where it happened
        ax.plot(
            failed, [0] * len(failed), "|", color="red", ms=12, mew=2, clip_on=False, label="failed"
        )
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sent at (s since the first request)")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(
        f"{result['model']} at {result['url']} ({result['endpoint']}): "
        f"{len(ok)} completed, {len(failed)} failed"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PER_REQUEST_TIMINGS = ("ttfts", "itls", "latencies", "start_times")


def save_json(result: dict, path: str, detailed: bool = True) -> None:
    """Write the result; without `detailed`, leave out the per-request timings."""
    if not detailed:
        result = {k: v for k, v in result.items() if k not in PER_REQUEST_TIMINGS}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
