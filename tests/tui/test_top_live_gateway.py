"""End to end: `kvgate serve --backend fake` in its own process, real requests from the
openai client, and the dashboard following the gateway's stats stream."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
from top_helpers import SIZE, wait_for

from studies.ports import free_port
from tui.app import TopApp
from tui.source import StatsSource
from tui.widgets import BackendsTable, TenantsTable

KVGATE = Path(sys.executable).with_name("kvgate")
ADMIN_KEY = "e2e-admin-key-0123456789abcdefghijklmn"  # the gateway wants 32+ chars

pytestmark = pytest.mark.skipif(
    not KVGATE.exists(), reason=f"the gateway's command is not installed at {KVGATE}"
)


@pytest.fixture
def gateway(tmp_path):
    port = free_port()
    env = os.environ | {
        "KVGATE_ADMIN_KEY": ADMIN_KEY,
        "KVGATE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}",
    }
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [str(KVGATE), "serve", "--backend", "fake", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}", proc, tmp_path / "serve.log"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def read_log(log: Path) -> str:
    return log.read_text()


async def wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    async with aiohttp.ClientSession() as http:
        while True:
            assert proc.poll() is None, f"kvgate serve exited:\n{read_log(log)}"
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)


async def admin(http: aiohttp.ClientSession, path: str, body: dict) -> dict:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with http.post(path, json=body, headers=headers) as resp:
        assert resp.status == 201, await resp.text()
        return await resp.json()


async def keep_busy(client: openai.AsyncOpenAI) -> None:
    """Eight requests at a time until cancelled."""

    async def one(i: int) -> None:
        await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": f"tell me story number {i} please"}],
            max_tokens=48,
        )

    i = 0
    while True:
        await asyncio.gather(*(one(i + j) for j in range(8)))
        i += 8


async def test_dashboard_shows_throughput_of_a_live_gateway(gateway):
    url, proc, log = gateway
    await wait_ready(url, proc, log)
    async with aiohttp.ClientSession(base_url=url) as http:
        tenant = await admin(http, "/admin/tenants", {"name": "acme", "rpm": 100000})
        key = await admin(http, f"/admin/tenants/{tenant['id']}/keys", {"name": "e2e"})
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key["key"], max_retries=0)
    load = asyncio.create_task(keep_busy(client))

    app = TopApp(StatsSource(url, ADMIN_KEY, interval=0.2))
    try:
        async with app.run_test(size=SIZE) as pilot:

            def tenant_busy() -> bool:
                rows = app.source.dashboard().tenants
                return any(r.name == "acme" and r.tokens_per_s > 0 for r in rows)

            await wait_for(pilot, tenant_busy)
            await pilot.pause()
            assert app.source.connection.state == "connected"
            assert not load.done(), load  # the load is still running, without errors

            board = app.source.dashboard()
            output = board.throughput[0]
            assert output.current > 0 and max(output.values) > 0
            title = app.query_one("#chart-output").border_title
            assert title.startswith("output ") and title.split()[1] != "0.0"

            tenants = app.query_one(TenantsTable)
            names = [str(tenants.get_row_at(i)[0]) for i in range(tenants.row_count)]
            assert "acme" in names
            backends = app.query_one(BackendsTable)
            assert [str(c) for c in backends.get_row_at(0)[:3]] == ["fake", "fake", "up"]
            assert board.totals["requests"] > 0
    finally:
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
        await client.close()
