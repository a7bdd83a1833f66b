"""Records gateway_load.jsonl: the stats stream of a real `kvgate serve` under load.

Two fake backends (paced like a small GPU: 40 ms to the first token, 90 tokens/s
per request; one fails 3% of its requests), five tenants with different quotas,
and a load that ramps up through 24 concurrent streams from the openai client.
`kvgate top --record` writes what the dashboard would have shown.
Run: .venv/bin/python tests/tui/data/record_load.py   (about 80 s)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import openai
from tqdm import tqdm

from tui.source import StatsSource

OUT = Path(__file__).with_name("gateway_load.jsonl")
ADMIN_KEY = "record-admin-key-0123456789"
SECONDS = 75
CONFIG = """
[[backends]]
name = "fake-a"
type = "fake"
served_model_name = "gemma-3-270m"
options = { ttft_ms = 40, tokens_per_second = 90, seed = 1 }

[[backends]]
name = "fake-b"
type = "fake"
served_model_name = "gemma-3-270m"
options = { ttft_ms = 55, tokens_per_second = 70, seed = 2, fail_rate = 0.03 }
"""
# name, quota, share of the clients
TENANTS = [
    ("acme", {"rpm": 3000, "daily_tokens": 5_000_000}, 8),
    ("globex", {"monthly_tokens": 60_000_000}, 6),
    ("initech", {"rpm": 600, "tpm": 60_000}, 4),
    ("hooli", {"rpm": 40}, 4),
    ("stark", {}, 2),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def client_loop(client: openai.AsyncOpenAI, start_after: float, stop: asyncio.Event) -> None:
    await asyncio.sleep(start_after)
    i = 0
    while not stop.is_set():
        i += 1
        try:
            stream = await client.chat.completions.create(
                model="gemma-3-270m",
                messages=[
                    {"role": "system", "content": "You are a helpful assistant for our shop."},
                    {"role": "user", "content": f"Write note {i} about the weather " * 8},
                ],
                max_tokens=40 + 20 * (i % 5),
                stream=True,
            )
            async for _ in stream:
                pass
        except openai.RateLimitError:
            await asyncio.sleep(1.0)  # a polite client backs off after a 429
        except openai.APIError:
            pass
        if stop.is_set():
            break


async def drive(url: str) -> None:
    """Create the tenants, start their clients, and record the stats stream meanwhile."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with aiohttp.ClientSession(base_url=url, headers=headers) as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get("/health") as resp:
                    if resp.status == 200:
                        break
            await asyncio.sleep(0.2)
        keys = []
        for name, quota, clients in TENANTS:
            async with http.post("/admin/tenants", json={"name": name, **quota}) as resp:
                tenant = await resp.json()
            async with http.post(f"/admin/tenants/{tenant['id']}/keys", json={}) as resp:
                keys.append(((await resp.json())["key"], clients))

    stop = asyncio.Event()
    tasks = []
    for key, clients in keys:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        # Clients join over the first 20 s: the charts show the ramp.
        tasks += [
            asyncio.create_task(client_loop(client, 20 * j / clients, stop)) for j in range(clients)
        ]
    with open(OUT, "w", encoding="utf-8") as record:  # noqa: ASYNC230
        source = StatsSource(url, ADMIN_KEY, interval=1.0, record=record)
        recorder = asyncio.create_task(source.run())
        for _ in tqdm(range(SECONDS), desc="recording", unit="s"):
            await asyncio.sleep(1)
        recorder.cancel()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(f"wrote {source.received} snapshots to {OUT}")


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    (tmp / "kvgate.toml").write_text(CONFIG)
    port = free_port()
    env = os.environ | {
        "KVGATE_ADMIN_KEY": ADMIN_KEY,
        "KVGATE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp / 'kvgate.db'}",
        "KVGATE_CONFIG": str(tmp / "kvgate.toml"),
        "KVGATE_PORT": str(port),
    }
    kvgate = Path(sys.executable).with_name("kvgate")
    proc = subprocess.Popen([str(kvgate), "serve"], cwd=tmp, env=env)
    try:
        asyncio.run(drive(f"http://127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
