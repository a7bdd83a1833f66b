"""Image tokens in the usage rows (issue 52), on SQLite and PostgreSQL: migration 0016
adds `image_tokens` to the usage rows and daily totals (0 on the rows before it, the
tables as declared after it); the usage writer stores each request's, and /admin/usage
(a tenant's own key: the tenant usage API) adds them up per day, tenant and key."""

from __future__ import annotations

import openai
import pytest
from sqlalchemy import text

from gateway.backends import BackendSpec
from gateway.db import Database, migrate
from tests.conftest import PG_URL
from tests.gateway.test_embeddings import on_store, rows, store  # noqa: F401 (a fixture)
from tests.gateway.test_images import TILES, data_url, image_chat, png
from tests.gateway.test_prefixes import schema_drift

VISION = [BackendSpec("vl", "fake", "", "fake-vl", {"vision": True})]


@pytest.fixture(params=["sqlite", "postgres"])
def database(request, tmp_path) -> Database:
    if request.param == "sqlite":
        return Database(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
    return Database(PG_URL, request.getfixturevalue("pg_schema"))


async def test_migration_0016_keeps_the_rows_before_it(database):
    try:
        await migrate(database, "0015")
        async with database.engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO usage_records (request_id, tenant_id, key_id, model,"
                    " prompt_tokens, completion_tokens, cached_tokens, latency_ms, status,"
                    " created_at) VALUES ('old', 't_1', 'key_1', 'm', 10, 5, 0, 1.0, 200, 1.0)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO daily_usage (tenant_id, day, model, requests, prompt_tokens,"
                    " completion_tokens, cached_tokens) VALUES ('t_1', '2026-01-01', 'm', 1, 10,"
                    " 5, 0)"
                )
            )
        assert await schema_drift(database) == []  # to head: the tables as declared
        async with database.engine.connect() as conn:
            row = await conn.scalar(text("SELECT image_tokens FROM usage_records"))
            daily = await conn.scalar(text("SELECT image_tokens FROM daily_usage"))
        assert (row, daily) == (0, 0)
    finally:
        await database.close()


async def test_rows_and_the_usage_api_hold_image_tokens(store, make_gateway):  # noqa: F811
    gw = await on_store(make_gateway, store, VISION)
    tenant, key = await gw.tenant("seer")
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    one = await client.chat.completions.create(**image_chat(data_url(png()), max_tokens=2))
    two = image_chat(data_url(png()), max_tokens=2)
    two["messages"][0]["content"] *= 2
    await client.chat.completions.create(**two)
    plain = [{"role": "user", "content": "what is this"}]
    await client.chat.completions.create(model="fake-vl", messages=plain, max_tokens=2)
    mine = [r for r in await rows(gw) if r.tenant_id == tenant["id"]]
    assert [r.image_tokens for r in mine] == [TILES, 2 * TILES, 0]
    assert mine[0].prompt_tokens == one.usage.prompt_tokens

    async with gw.http.get(
        gw.url + "/admin/usage", headers={"Authorization": f"Bearer {key}"}
    ) as r:
        report = await r.json()
    assert r.status == 200
    [day] = report["data"]
    assert day["image_tokens"] == report["total"]["image_tokens"] == 3 * TILES
    assert day["prompt_tokens"] == sum(r.prompt_tokens for r in mine)
    assert [t["image_tokens"] for t in report["tenants"]] == [3 * TILES]
    assert [k["image_tokens"] for k in report["keys"]] == [3 * TILES]
