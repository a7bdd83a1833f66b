"""Parts 2 and 3 of `python -m studies.hostile`: event-loop stalls under attack, and usage
rows lost to `kill -9` under load.

The stall prober runs in a process of its own, so the attackers' client work cannot
delay it: it sends `GET /health` on one keep-alive connection every few milliseconds,
and a health check's latency is how long the gateway's event loop left it waiting.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from studies.harness import nearest_rank

CHAT = "/v1/chat/completions"
GOAL_MS = 50  # issue 13: the event loop's longest stall under attack
SETTLED_MS = 50  # the gateway has recovered once /health answers within this again


@dataclass
class Sample:
    at: float  # time.monotonic() when sent: one clock for every process on the machine
    latency_s: float
    ok: bool


def _probe_main(url: str, interval_s: float, ready, stop, conn) -> None:
    conn.send(asyncio.run(_probe(url, interval_s, ready, stop)))
    conn.close()


async def _probe(url: str, interval_s: float, ready, stop) -> list[tuple[float, float, bool]]:
    samples = []
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        next_at = time.monotonic()
        while not stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            t0 = time.monotonic()
            try:
                async with http.get(url + "/health", timeout=timeout) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            samples.append((t0, time.monotonic() - t0, ok))
            ready.set()
            next_at = max(next_at + interval_s, time.monotonic())
    return samples


class Prober:
    """`GET /health` every `interval_s` from a separate process, until `stop()`."""

    def __init__(self, url: str, interval_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        ready, self._stop = ctx.Event(), ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_probe_main, args=(url, interval_s, ready, self._stop, send)
        )
        self._proc.start()
        if not ready.wait(60):  # windows start once it probes: none begins unwatched
            self._proc.kill()
            raise RuntimeError("the /health prober did not start")

    def stop(self) -> list[Sample]:
        self._stop.set()
        samples = [Sample(*s) for s in self._recv.recv()]
        self._proc.join()
        return samples


def window_stats(samples: list[Sample], start: float, end: float) -> dict:
    """Latency figures of the health checks sent in [start, end)."""
    inside = [s for s in samples if start <= s.at < end]
    lat = sorted(s.latency_s * 1000 for s in inside)
    if not lat:
        return {
            "samples": 0,
            "p50_ms": None,
            "p99_ms": None,
            "max_ms": None,
            "over_goal": 0,
            "failed": 0,
        }

    return {
        "samples": len(lat),
        "p50_ms": nearest_rank(lat, 50),
        "p99_ms": nearest_rank(lat, 99),
        "max_ms": lat[-1],
        "over_goal": sum(1 for x in lat if x >= GOAL_MS),  # one outlier, or many?
        "failed": sum(1 for s in inside if not s.ok),
    }


@dataclass
class Attack:
    """Bodies sent over and over by `concurrency` clients for `seconds`."""

    name: str
    requests: list[tuple[str, bytes, dict[str, str]]]  # path, body, headers; one per client
    concurrency: int
    seconds: float


async def run_attack(url: str, attack: Attack) -> dict[str, int]:
    """Send the attack; what the attackers got back, by status (or by failure)."""
    got: Counter[str] = Counter()
    end = time.monotonic() + attack.seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def client(i: int) -> None:
            path, data, headers = attack.requests[i % len(attack.requests)]
            while (left := end - time.monotonic()) > 0:
                try:
                    async with http.post(
                        url + path,
                        data=data,
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(total=left),
                        auto_decompress=False,
                    ) as r:
                        await r.read()
                        got[str(r.status)] += 1
                except TimeoutError:
                    got["cut off at the window's end"] += 1
                except aiohttp.ClientError as e:
                    got[type(e).__name__] += 1

        await asyncio.gather(*(client(i) for i in range(attack.concurrency)))
    return dict(got)


async def wait_settled(url: str, limit_s: float = 30) -> float:
    """Wait until three health checks in a row answer within SETTLED_MS; returns when."""
    deadline, good = time.monotonic() + limit_s, 0
    async with aiohttp.ClientSession() as http:
        while good < 3 and time.monotonic() < deadline:
            t0 = time.monotonic()
            try:
                async with http.get(url + "/health") as r:
                    await r.read()
                fast = (time.monotonic() - t0) * 1000 < SETTLED_MS
            except aiohttp.ClientError:
                fast = False
            good = good + 1 if fast else 0
            await asyncio.sleep(0.02)
    return time.monotonic()


async def attack_windows(url: str, quiet_s: float, attacks: list[Attack]) -> list[dict]:
    """A quiet window, then each attack in turn with the time the gateway took to recover.
    Times are time.monotonic(), comparable with the prober's samples."""
    start = time.monotonic()
    await asyncio.sleep(quiet_s)
    windows = [{"name": "quiet", "start": start, "end": time.monotonic(), "settled": None}]
    for attack in attacks:
        start = time.monotonic()
        got = await run_attack(url, attack)
        end = time.monotonic()
        settled = await wait_settled(url)
        windows.append(
            {
                "name": attack.name,
                "start": start,
                "end": end,
                "settled": settled,
                "attackers_got": got,
                "concurrency": attack.concurrency,
            }
        )
        await asyncio.sleep(0.5)
    return windows


@dataclass
class LoadLog:
    """What the load clients saw: ids of responses received whole, and the rest."""

    completed: list[str] = field(default_factory=list)
    completed_streams: int = 0
    incomplete: list[str] = field(default_factory=list)  # an id was seen, no whole answer
    errors_before_kill: Counter[str] = field(default_factory=Counter)
    id_mismatches: int = 0  # x-request-id differs from the body's id


async def _one(http: aiohttp.ClientSession, url: str, key: str, body: dict, log: LoadLog) -> None:
    stream = body["stream"]
    rid = None
    async with http.post(
        url + CHAT,
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=aiohttp.ClientTimeout(total=60),
    ) as r:
        rid = r.headers.get("x-request-id")
        try:
            data = await r.read()
        except (aiohttp.ClientError, TimeoutError):
            if rid:
                log.incomplete.append(rid)
            raise
    if r.status != 200:
        log.errors_before_kill[str(r.status)] += 1
        return
    if stream:
        first = data.split(b"\n\n", 1)[0].removeprefix(b"data: ")
        body_id = json.loads(first).get("id") if first.startswith(b"{") else None
        whole = data.rstrip().endswith(b"data: [DONE]")
    else:
        body_id = json.loads(data).get("id")
        whole = True
    log.id_mismatches += body_id != rid
    if whole and rid:
        log.completed.append(rid)
        log.completed_streams += stream
    elif rid:
        log.incomplete.append(rid)


async def load_then_kill(
    url: str, key: str, clients: int, load_s: float, kill: Callable[[], None]
) -> LoadLog:
    """`clients` clients (every other one streaming) send chats for `load_s`, then `kill`
    runs while they are still sending; each client stops at its first failure after it."""
    log, killed = LoadLog(), asyncio.Event()

    async def client(i: int) -> None:
        for j in itertools.count():
            body = {
                "model": "fake-model",
                "max_tokens": 16,
                "stream": i % 2 == 1,
                "messages": [{"role": "user", "content": f"load {i} {j}"}],
            }
            try:
                await _one(http, url, key, body, log)
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                if killed.is_set():
                    return
                log.errors_before_kill[type(e).__name__] += 1
                await asyncio.sleep(0.05)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        await asyncio.sleep(load_s)
        killed.set()
        kill()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return log


def lost_rows(completed: Iterable[str], recorded: set[str]) -> list[str]:
    """Responses a client received whole that have no usage row: the goal is none."""
    return [rid for rid in completed if rid not in recorded]


def billed_not_delivered(completed: Iterable[str], recorded: set[str]) -> list[str]:
    """Usage rows of requests whose clients never received a whole response."""
    done = set(completed)
    return sorted(rid for rid in recorded if rid not in done)
