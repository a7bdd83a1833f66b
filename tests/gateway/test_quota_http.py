"""Quotas through HTTP: exactly the limit gets through, refusals are OpenAI-shaped 429s."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import PG_URL, away_from_minute_boundary, start_gateway


async def _fire(url: str, key: str, n: int, max_tokens: int = 2) -> list[tuple[int, dict, dict]]:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "fake-model", "messages": messages, "max_tokens": max_tokens}
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def one():
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                return r.status, dict(r.headers), await r.json()

        return await asyncio.gather(*(one() for _ in range(n)))


async def test_200_concurrent_against_50_rpm(gw):
    _, key = await gw.tenant(rpm=50)
    await away_from_minute_boundary()
    results = await _fire(gw.url, key, 200)
    statuses = [s for s, _, _ in results]
    assert statuses.count(200) == 50
    assert statuses.count(429) == 150
    _, headers, body = next(r for r in results if r[0] == 429)
    assert body["error"]["type"] == "rate_limit_error"
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert int(headers["Retry-After"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "50"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    _, ok_headers, _ = next(r for r in results if r[0] == 200)
    assert ok_headers["x-ratelimit-limit-requests"] == "50"
    _, usage = await gw.admin("GET", "/admin/usage")
    assert usage["total"]["requests"] == 50


async def test_tpm_counts_reserved_tokens(gw):
    # each request reserves 3 prompt + 12 max_tokens; 3 fit in the minute, the 4th does not
    _, key = await gw.tenant(tpm=45)
    await away_from_minute_boundary()
    statuses = [s for s, _, _ in await _fire(gw.url, key, 6, max_tokens=12)]
    assert statuses.count(200) == 3


@pytest.mark.pg
def test_two_gateways_on_postgres_enforce_one_limit(tmp_path, pg_schema):
    env = {"KVGATE_DATABASE_SCHEMA": pg_schema}
    a = start_gateway(tmp_path, "--backend", "fake", database_url=PG_URL, extra_env=env)
    b = start_gateway(tmp_path, "--backend", "fake", database_url=PG_URL, extra_env=env)
    try:
        headers = a.admin_headers
        tenants_url = a.url + "/admin/tenants"

        async def run():
            async with aiohttp.ClientSession() as http:
                tenant_body = {"name": "pg", "rpm": 50}
                async with http.post(tenants_url, json=tenant_body, headers=headers) as r:
                    tenant = await r.json()
                keys_url = f"{tenants_url}/{tenant['id']}/keys"
                async with http.post(keys_url, json={}, headers=headers) as r:
                    key = (await r.json())["key"]
            await away_from_minute_boundary()
            ra, rb = await asyncio.gather(_fire(a.url, key, 100), _fire(b.url, key, 100))
            return [s for s, _, _ in ra + rb]

        statuses = asyncio.run(run())
        assert statuses.count(200) == 50
        assert statuses.count(429) == 150
    finally:
        a.stop()
        b.stop()
