"""Spend in money: prices from the config, each request's spend computed from its usage
and stored on its usage row, spend per tenant and per key in /admin/usage and per tenant
in /admin/stats, money budgets on tenants and keys refusing with a 429 that names them
(exactly, under concurrency), a model with no price free of them, and the migration that
adds the columns."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal

import openai
import pytest
from openai import AsyncOpenAI
from sqlalchemy import select, text

from gateway.backends import BackendSpec
from gateway.config_load import load_settings
from gateway.db import Database, UsageRecord, migrate
from gateway.tenancy.quota.prices import Price, to_nanos
from tests.conftest import PG_URL
from tests.gateway.test_prefixes import schema_drift

# USD per million tokens, as a provider lists them
PRICES = {"input": 2.5, "cached_input": 1.25, "output": 10}
LONG_PROMPT = " ".join(f"w{i}" for i in range(40))  # two full 16-token blocks to cache


def expected_nanos(prices: dict, prompt: int, cached: int, completion: int) -> int:
    """The spend of one request, figured here from the prices in dollars."""
    usd = (
        Decimal(str(prices["input"])) * (prompt - cached)
        + Decimal(str(prices.get("cached_input", prices["input"]))) * cached
        + Decimal(str(prices["output"])) * completion
    ) / 10**6
    return int((usd * 10**9).to_integral_value("ROUND_CEILING"))


def test_price_spend_is_exact_and_rounds_up_to_the_nanodollar() -> None:
    price = Price.from_usd_per_million("m", PRICES)
    assert price.spend(1000, 600, 50) == expected_nanos(PRICES, 1000, 600, 50) == 2_250_000
    assert price.worst_case(1000, 50) == expected_nanos(PRICES, 1000, 0, 50)
    cheap = {"input": 0.000001, "output": 0.075}  # a picodollar a token; cached: as input
    price = Price.from_usd_per_million("m", cheap)
    assert price.cached_input == price.input == 1
    assert price.spend(1, 1, 0) == 1  # one picodollar costs a nanodollar, never 0
    assert price.spend(7, 3, 13) == expected_nanos(cheap, 7, 3, 13) == 976
    assert Price().spend(10**6, 0, 10**6) == 0  # no price: free
    assert to_nanos(0.1) == 100_000_000 and to_nanos(1e9) == 10**18


def test_prices_come_from_the_config_file(tmp_path) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text(
        '[prices."fake-model"]\ninput = 0.15\ncached_input = 0.075\noutput = 0.6\n'
        "[prices.other]\ninput = 3\noutput = 15\n"
    )
    prices = load_settings(config, environ={}).prices
    assert prices["fake-model"] == Price(input=150_000, cached_input=75_000, output=600_000)
    assert prices["other"].cached_input == prices["other"].input == 3_000_000
    assert prices["other"].usd_per_million() == {"input": 3, "cached_input": 3, "output": 15}
    for body, message in (
        ("[prices.m]\ninput = 1\nouptut = 2\n", "prices.m: unknown fields ['ouptut']"),
        ("[prices.m]\ninput = 0.0000001\n", "prices.m.input must be >= 0 USD per million"),
        ("[prices.m]\noutput = -1\n", "prices.m.output must be >= 0"),
        ('[prices.m]\noutput = "a lot"\n', "prices.m.output must be a number"),
        ("[prices]\nm = 3\n", "prices.m must be a table"),
    ):
        config.write_text(body)
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
            load_settings(config, environ={})


def priced_backends() -> list[BackendSpec]:
    return [
        BackendSpec("fake", "fake", "", "fake-model", {}),
        BackendSpec("free", "fake", "", "free-model", {}),
    ]


@pytest.fixture
async def priced(make_gateway):
    return await make_gateway(priced_backends(), prices={"fake-model": PRICES})


def client(gw, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def rows(gw) -> dict[str, UsageRecord]:
    async with gw.state.db.session() as s:
        return {r.request_id: r for r in (await s.scalars(select(UsageRecord))).all()}


async def test_each_request_costs_its_usage_at_the_prices(priced):
    tenant, key = await priced.tenant()
    c = client(priced, key)
    first = await c.completions.create(model="fake-model", prompt=LONG_PROMPT, max_tokens=5)
    again = await c.completions.create(model="fake-model", prompt=LONG_PROMPT, max_tokens=7)
    free = await c.completions.create(model="free-model", prompt=LONG_PROMPT, max_tokens=5)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and cached == 32
    recorded = await rows(priced)
    spends = {}
    for done in (first, again):
        u = done.usage
        spends[done.id] = expected_nanos(
            PRICES, u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens
        )
        assert recorded[done.id].spend_nano_usd == spends[done.id]
    assert recorded[free.id].spend_nano_usd == 0  # no price: free
    total = sum(spends.values())

    status, usage = await priced.admin("GET", f"/admin/usage?tenant_id={tenant['id']}")
    assert status == 200
    by_model = {d["model"]: d["spend"] for d in usage["data"]}
    assert by_model == {"fake-model": total / 1e9, "free-model": 0.0}
    assert usage["total"]["spend"] == total / 1e9
    assert [(t["tenant_id"], t["spend"]) for t in usage["tenants"]] == [(tenant["id"], total / 1e9)]
    (by_key,) = usage["keys"]
    assert (by_key["tenant_id"], by_key["requests"], by_key["spend"]) == (
        tenant["id"],
        3,
        total / 1e9,
    )
    status, _ = await priced.admin("GET", "/admin/usage?tenant_id=t_unknown")
    assert status == 404


async def test_stats_show_a_tenants_spend_and_money_budgets(priced):
    tenant, key = await priced.tenant(daily_spend=1.5)
    done = await client(priced, key).completions.create(
        model="fake-model", prompt=LONG_PROMPT, max_tokens=5
    )
    u = done.usage
    cached = u.prompt_tokens_details.cached_tokens
    spent = expected_nanos(PRICES, u.prompt_tokens, cached, u.completion_tokens)
    status, snap = await priced.admin("GET", "/admin/stats")
    assert status == 200
    quota = next(t["quota"] for t in snap["tenants"] if t["id"] == tenant["id"])
    # dollars, as the budgets are given: the same counters the budgets are held to
    assert (quota["daily_spend"], quota["monthly_spend"]) == (1.5, None)
    assert quota["daily_spend_used"] == quota["monthly_spend_used"] == spent / 1e9 > 0


async def test_a_keys_money_budget_refuses_and_a_free_model_passes(priced):
    tenant, _ = await priced.tenant(monthly_spend=1000.0)
    status, key = await priced.admin(
        "POST", f"/admin/tenants/{tenant['id']}/keys", {"daily_spend": 0.5}
    )
    assert status == 201 and (key["daily_spend"], key["monthly_spend"]) == (0.5, None)
    assert tenant["monthly_spend"] == 1000.0
    c = client(priced, key["key"])
    done = await c.completions.create(model="fake-model", prompt="one two three", max_tokens=4)
    u = done.usage
    one = expected_nanos(PRICES, u.prompt_tokens, 0, u.completion_tokens)  # = its worst case
    # exactly two more such requests fit under the budget
    budget = (3 * one) / 1e9
    status, key = await priced.admin("PATCH", f"/admin/keys/{key['id']}", {"daily_spend": budget})
    assert status == 200 and key["daily_spend"] == budget
    # a stop at the second word: its spend settles below what admission reserved
    short = await c.completions.create(
        model="fake-model", prompt="one two three", max_tokens=4, stop=[" "]
    )
    assert short.usage.completion_tokens == 2
    spent = one + expected_nanos(PRICES, u.prompt_tokens, 0, 2)
    assert (await priced.state.quota.used(key["id"], time.time()))["daily_spend"] == spent
    await c.completions.create(model="fake-model", prompt="one two three", max_tokens=4)
    with pytest.raises(openai.RateLimitError) as e:
        await c.completions.create(model="fake-model", prompt="one two three", max_tokens=4)
    body = e.value.body
    assert body["code"] == "rate_limit_exceeded" and body["type"]
    assert "this API key's spend per day (daily_spend)" in body["message"]
    assert int(e.value.response.headers["Retry-After"]) >= 1
    # what is left (two completion tokens' worth) admits a request whose worst case fits,
    # and a model with no price is held to no money budget
    await c.completions.create(model="fake-model", prompt="one two three", max_tokens=1)
    await c.completions.create(model="free-model", prompt="one two three", max_tokens=4)
    status, lifted = await priced.admin("PATCH", f"/admin/keys/{key['id']}", {"daily_spend": None})
    assert status == 200 and lifted["daily_spend"] is None
    await c.completions.create(model="fake-model", prompt="one two three", max_tokens=4)


async def test_a_request_no_money_budget_could_ever_hold_is_a_400(priced):
    tenant, key = await priced.tenant(daily_spend=1000.0)
    status, small = await priced.admin(
        "POST", f"/admin/tenants/{tenant['id']}/keys", {"monthly_spend": 0.000001}
    )
    assert status == 201
    c = client(priced, small["key"])
    with pytest.raises(openai.BadRequestError) as e:
        await c.completions.create(model="fake-model", prompt="one two three", max_tokens=4)
    body = e.value.body
    assert body["code"] == "exceeds_tenant_limit"
    assert "this API key's limit on spend per month (monthly_spend) is $0.000001" in body["message"]
    assert "never be admitted" in body["message"]
    # refused before admission: nothing was taken from any counter, and a free model passes
    assert (await priced.state.quota.used(small["id"], time.time()))["monthly_spend"] == 0
    await c.completions.create(model="free-model", prompt="one two three", max_tokens=4)
    status, _ = await priced.admin("PATCH", f"/admin/tenants/{tenant['id']}", {"daily_spend": 0})
    with pytest.raises(openai.BadRequestError, match="your tenant's limit on spend per day"):
        await client(priced, key).completions.create(model="fake-model", prompt="one", max_tokens=1)


async def test_a_tenants_money_budget_is_exact_under_concurrency(priced):
    prompt = "one two three"
    tenant, key = await priced.tenant()
    c = client(priced, key)
    probe = await c.completions.create(model="fake-model", prompt=prompt, max_tokens=3)
    one = expected_nanos(PRICES, probe.usage.prompt_tokens, 0, 3)
    status, _ = await priced.admin(
        "PATCH", f"/admin/tenants/{tenant['id']}", {"daily_spend": (one * 8) / 1e9}
    )
    assert status == 200

    async def fire():
        try:
            await c.completions.create(model="fake-model", prompt=prompt, max_tokens=3)
            return 200
        except openai.RateLimitError as e:
            assert "your tenant's spend per day (daily_spend)" in e.message
            return 429

    results = await asyncio.gather(*(fire() for _ in range(30)))
    assert results.count(200) == 7 and results.count(429) == 23  # 8 with the probe
    assert sum(r.spend_nano_usd for r in (await rows(priced)).values()) == 8 * one
    used = await priced.state.quota.used(tenant["id"], time.time())
    assert used["daily_spend"] == used["monthly_spend"] == 8 * one


async def test_spend_counters_are_reloaded_on_restart(priced):
    tenant, _ = await priced.tenant()
    status, key = await priced.admin(
        "POST", f"/admin/tenants/{tenant['id']}/keys", {"monthly_spend": 10.0}
    )
    done = await client(priced, key["key"]).completions.create(
        model="fake-model", prompt="one two three", max_tokens=2
    )
    cost = expected_nanos(PRICES, done.usage.prompt_tokens, 0, 2)
    used = await priced.state.tenants.committed_usage(time.time())
    for owner in (tenant["id"], key["id"]):
        assert used[owner]["daily_spend"] == used[owner]["monthly_spend"] == cost, owner


async def _migrate_0005_then_head(db: Database) -> None:
    await migrate(db, "0005")
    async with db.engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO usage_records (request_id, tenant_id, key_id, model, prompt_tokens,"
                " completion_tokens, cached_tokens, latency_ms, status, created_at) VALUES"
                " ('old', 't_1', 'key_1', 'm', 10, 5, 0, 1.0, 200, 1.0)"
            )
        )
        await conn.execute(
            text(
                "INSERT INTO daily_usage (tenant_id, day, model, requests, prompt_tokens,"
                " completion_tokens, cached_tokens) VALUES ('t_1', '2024-01-01', 'm', 1, 10, 5, 0)"
            )
        )
    assert await schema_drift(db) == []  # upgrades to head: the tables as declared
    async with db.engine.connect() as conn:
        old = await conn.scalar(text("SELECT spend_nano_usd FROM usage_records"))
        daily = await conn.scalar(text("SELECT spend_nano_usd FROM daily_usage"))
        budgets = await conn.execute(text("SELECT daily_spend, monthly_spend FROM quotas"))
    assert (old, daily, budgets.all()) == (0, 0, [])  # rows before prices cost nothing


async def test_migration_0006_applies_over_rows_on_sqlite(tmp_path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
    try:
        await _migrate_0005_then_head(db)
    finally:
        await db.close()


async def test_migration_0006_applies_over_rows_on_postgresql(pg_schema) -> None:
    db = Database(PG_URL, pg_schema)
    try:
        await _migrate_0005_then_head(db)
    finally:
        await db.close()
