"""`kvgate bench noisy`: does one tenant's flood starve another? (issue 15)

Three phases against one server, each tenant with its own API key:
1. alone: tenant B sends short requests at a steady rate, nothing else runs;
2. flood: tenant A keeps `--flood` long requests in flight (each one replaced as it
   ends) while B sends the same steady stream: B's TTFT against phase 1's;
3. backlogged: A and B both keep `--backlog` requests of one shape in flight for
   `--backlog-s` seconds: how the output tokens were shared. With `--key-heavy` (a
   tenant whose fair-share weight is `--heavy-weight`) phase 3 runs again, heavy
   against B.

Service is counted in streamed chunks, one per output token (a chunk that holds part
of a character waits for the rest, so a few tokens may share a chunk). Over the
backlogged window it reports each tenant's tokens, the share ratio against the weights,
the largest gap between the two tenants' weighted service (tokens), Jain's fairness
index of the weighted services (1 is equal), and the total output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from bench.client import build_payload, chunk_text, sse_events
from bench.datasets import random_words
from bench.metrics import percentile


@dataclass
class Shape:
    """One tenant's requests: prompt words and output tokens."""

    input_len: int
    output_len: int


@dataclass
class Stream:
    """One request as it streamed; kept when it is cancelled at a phase's end."""

    tenant: str
    start: float
    token_times: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None


@dataclass
class Client:
    session: aiohttp.ClientSession
    url: str
    model: str
    rng: random.Random

    async def stream(self, key: str, tenant: str, shape: Shape, rec: Stream) -> None:
        """Send one completion and time each chunk of text into `rec`."""
        prompt = random_words(self.rng, shape.input_len)
        payload = build_payload("completions", self.model, prompt, shape.output_len, 0.0, True)
        headers = {"Authorization": f"Bearer {key}"}
        try:
            async with self.session.post(
                self.url + "/v1/completions", json=payload, headers=headers
            ) as response:
                if response.status != 200:
                    rec.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                    return
                async for event in sse_events(response):
                    if event == "[DONE]":
                        return
                    data = json.loads(event)
                    if data.get("error"):
                        rec.error = json.dumps(data["error"])[:300]
                        return
                    if chunk_text(data, "completions"):
                        rec.token_times.append(time.perf_counter())
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
            rec.error = f"{type(e).__name__}: {e}"


async def keep_in_flight(
    client: Client, key: str, tenant: str, shape: Shape, n: int, stop: asyncio.Event
) -> list[Stream]:
    """`n` requests in flight, each replaced as it ends, until `stop`; the ones still
    running then are cancelled (their streams so far are kept)."""
    records: list[Stream] = []

    async def loop() -> None:
        while not stop.is_set():
            rec = Stream(tenant, time.perf_counter())
            records.append(rec)
            await client.stream(key, tenant, shape, rec)
            if rec.error:
                raise RuntimeError(f"{tenant}: {rec.error}")

    tasks = [asyncio.create_task(loop()) for _ in range(n)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if not isinstance(result, asyncio.CancelledError | type(None)):
            raise result
    return records


async def steady(client: Client, key: str, shape: Shape, n: int, interval: float) -> list[Stream]:
    """`n` requests from B, one every `interval` seconds, each awaited to its end."""
    records, tasks = [], []
    for i in range(n):
        rec = Stream("B", time.perf_counter())
        records.append(rec)
        tasks.append(asyncio.create_task(client.stream(key, "B", shape, rec)))
        if i < n - 1:
            await asyncio.sleep(interval)
    await asyncio.gather(*tasks)
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"B: {len(failed)} requests failed: {failed[:3]}")
    return records


def ttft_summary(records: list[Stream]) -> dict:
    ttfts = [r.ttft * 1000 for r in records if r.ttft is not None]
    return {
        "requests": len(records),
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p99_ms": percentile(ttfts, 99),
    }


def tokens_in(records: list[Stream], t0: float, t1: float) -> int:
    return sum(t0 <= t < t1 for r in records for t in r.token_times)


def share_summary(
    a: list[Stream], b: list[Stream], weights: tuple[float, float], t0: float, t1: float
) -> dict:
    """How A and B shared the output tokens in [t0, t1), both backlogged throughout."""
    events = sorted(
        [(t, 1 / weights[0], 0.0) for r in a for t in r.token_times if t0 <= t < t1]
        + [(t, 0.0, 1 / weights[1]) for r in b for t in r.token_times if t0 <= t < t1]
    )
    sa = sb = gap = 0.0
    for _, da, db in events:
        sa, sb = sa + da, sb + db
        gap = max(gap, abs(sa - sb))
    tokens_a, tokens_b = tokens_in(a, t0, t1), tokens_in(b, t0, t1)
    return {
        "weights": list(weights),
        "seconds": t1 - t0,
        "tokens": {"A": tokens_a, "B": tokens_b},
        # 1.0 is exactly the weights' share
        "share_vs_weights": (tokens_a / weights[0]) / (tokens_b / weights[1]),
        "largest_gap_tokens": gap,  # weighted service, tokens / weight
        "jain": (sa + sb) ** 2 / (2 * (sa * sa + sb * sb)),
        "output_tokens_per_s": (tokens_a + tokens_b) / (t1 - t0),
    }


async def phase_flood(client: Client, args: argparse.Namespace) -> dict:
    stop = asyncio.Event()
    flood = asyncio.create_task(
        keep_in_flight(client, args.key_a, "A", args.flood_shape, args.flood, stop)
    )
    await asyncio.sleep(args.warmup_s)  # the flood fills the server before B comes
    t0 = time.perf_counter()
    b = await steady(client, args.key_b, args.b_shape, args.b_requests, args.b_interval)
    t1 = time.perf_counter()
    stop.set()
    a = await flood
    tokens = {"A": tokens_in(a, t0, t1), "B": tokens_in(b, t0, t1)}
    return {
        "B": ttft_summary(b),
        "tokens": tokens,
        "output_tokens_per_s": (tokens["A"] + tokens["B"]) / (t1 - t0),
        "seconds": t1 - t0,
    }


async def phase_backlog(
    client: Client, args: argparse.Namespace, key_a: str, weight_a: float
) -> dict:
    stop = asyncio.Event()
    loads = [
        asyncio.create_task(
            keep_in_flight(client, key, name, args.backlog_shape, args.backlog, stop)
        )
        for key, name in ((key_a, "A"), (args.key_b, "B"))
    ]
    await asyncio.sleep(args.warmup_s)  # both lines fill before the window opens
    t0 = time.perf_counter()
    await asyncio.sleep(args.backlog_s)
    t1 = time.perf_counter()
    stop.set()
    a, b = await asyncio.gather(*loads)
    return share_summary(a, b, (weight_a, 1.0), t0, t1)


PHASES = ("alone", "flood", "backlog", "backlog_weighted")


async def run_phase(client: Client, args: argparse.Namespace, phase: str) -> dict:
    if phase == "alone":
        b = await steady(client, args.key_b, args.b_shape, args.b_requests, args.b_interval)
        return {"B": ttft_summary(b)}
    if phase == "flood":
        return await phase_flood(client, args)
    if phase == "backlog":
        return await phase_backlog(client, args, args.key_a, 1.0)
    return await phase_backlog(client, args, args.key_heavy, args.heavy_weight)


async def run_noisy(targets: dict[str, argparse.Namespace], progress=print) -> dict[str, dict]:
    """Every phase against each target (a server and its keys) in turn, phase by phase,
    so that noise on a shared machine falls on all of them alike; a report per target."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    reports: dict[str, dict] = {name: {} for name in targets}
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        clients = {
            name: Client(session, a.url.rstrip("/"), a.model, random.Random(a.seed))
            for name, a in targets.items()
        }
        for phase in PHASES:
            for name, args in targets.items():
                if phase == "backlog_weighted" and not args.key_heavy:
                    continue
                progress(f"{name}: {phase}")
                reports[name][phase] = await run_phase(clients[name], args, phase)
    for name, report in reports.items():
        alone, flood = report["alone"]["B"], report["flood"]
        flood["B_ttft_p99_vs_alone"] = flood["B"]["ttft_p99_ms"] / alone["ttft_p99_ms"]
        report["args"] = {
            k: asdict(v) if isinstance(v, Shape) else v
            for k, v in vars(targets[name]).items()
            if not k.startswith("key") and k != "run"
        }
    return reports


def add_target_args(p: argparse.ArgumentParser) -> None:
    """The server and the tenants' keys (studies.noisy_neighbour makes its own)."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", required=True, help="model id")
    p.add_argument("--key-a", required=True, help="API key of the flooding tenant A")
    p.add_argument("--key-b", required=True, help="API key of the steady tenant B")
    p.add_argument("--key-heavy", help="API key of a tenant of weight --heavy-weight")


def add_noisy_args(p: argparse.ArgumentParser) -> None:
    """The workload."""
    p.add_argument("--heavy-weight", type=float, default=2.0, help="--key-heavy's weight")
    p.add_argument("--flood", type=int, default=32, help="A's requests in flight")
    p.add_argument("--flood-input-len", type=int, default=32)
    p.add_argument("--flood-output-len", type=int, default=256)
    p.add_argument("--b-requests", type=int, default=20, help="B's requests per phase")
    p.add_argument("--b-interval", type=float, default=1.0, help="seconds between B's requests")
    p.add_argument("--b-input-len", type=int, default=32)
    p.add_argument("--b-output-len", type=int, default=16)
    p.add_argument("--backlog", type=int, default=16, help="each tenant's requests in flight")
    p.add_argument("--backlog-input-len", type=int, default=32)
    p.add_argument("--backlog-output-len", type=int, default=32)
    p.add_argument("--backlog-s", type=float, default=40.0, help="the measured window")
    p.add_argument("--warmup-s", type=float, default=5.0, help="load before a window opens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", metavar="FILE", help="write the JSON report here")


def with_shapes(args: argparse.Namespace) -> argparse.Namespace:
    args.flood_shape = Shape(args.flood_input_len, args.flood_output_len)
    args.b_shape = Shape(args.b_input_len, args.b_output_len)
    args.backlog_shape = Shape(args.backlog_input_len, args.backlog_output_len)
    return args


def cmd_noisy(args: argparse.Namespace) -> int:
    targets = {"server": with_shapes(args)}
    report = asyncio.run(run_noisy(targets, lambda m: print(m, file=sys.stderr)))["server"]
    args.result = report  # the history's record of the run (bench/cli.py)
    text = json.dumps(report, indent=2, default=str)  # --results-dir is a Path
    print(text)
    if args.save_result:
        with open(args.save_result, "w") as f:
            f.write(text + "\n")
    return 0
