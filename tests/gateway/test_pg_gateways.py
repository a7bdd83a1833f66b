"""Three gateways on one PostgreSQL hold one limit between them, not three.

Each burst is sent to the three gateways in turn, all at once. The fake backend answers
after 1.5 s, so no request settles (and gives its slot or tokens back) while the burst
is being admitted: exactly the limit's worth gets through, of every kind.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import PG_URL, away_from_minute_boundary, start_gateway

SLOW = '[[backends]]\nname = "fake"\ntype = "fake"\noptions = { ttft_ms = 1500 }\n'


async def _burst(urls: list[str], key: str, n: int, max_tokens: int) -> list[int]:
    body = {"model": "fake-model", "prompt": "one two three", "max_tokens": max_tokens}
    headers = {"Authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(i: int) -> int:
            url = urls[i % len(urls)] + "/v1/completions"
            async with http.post(url, json=body, headers=headers) as r:
                await r.read()
                return r.status

        return list(await asyncio.gather(*(one(i) for i in range(n))))


@pytest.mark.pg
def test_three_gateways_hold_one_limit_of_every_kind(tmp_path, pg_schema):
    env = {"KVGATE_DATABASE_SCHEMA": pg_schema}
    gateways = [
        start_gateway(tmp_path, database_url=PG_URL, extra_env=env, config=SLOW) for _ in range(3)
    ]
    try:
        urls = [g.url for g in gateways]
        # (limit, burst size, max_tokens, admitted): each request takes 3 + max_tokens
        cases = {
            "rpm": (50, 300, 2, 50),
            "tpm": (150, 60, 12, 10),
            "daily_tokens": (75, 60, 12, 5),
            "max_concurrent": (7, 60, 2, 7),
        }
        keys = {
            field: gateways[i % 3].tenant_key(f"three-{field}", **{field: limit})[1]
            for i, (field, (limit, *_)) in enumerate(cases.items())
        }

        async def run() -> dict[str, list[int]]:
            await away_from_minute_boundary(20)
            bursts = [
                _burst(urls, keys[field], n, max_tokens)
                for field, (_, n, max_tokens, _) in cases.items()
            ]
            return dict(zip(cases, await asyncio.gather(*bursts), strict=True))

        statuses = asyncio.run(run())
        for field, (_, n, _, admitted) in cases.items():
            codes = statuses[field]
            assert codes.count(200) == admitted, (field, codes.count(200))
            assert codes.count(429) == n - admitted, field
    finally:
        for g in gateways:
            g.stop()
