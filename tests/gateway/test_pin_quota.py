"""Pinned prefixes are a tenant's work: admitted through its quota, billed as usage,
capped per tenant, and refused with a 400 when they hold characters a database cannot.

Each test runs on SQLite (memory quota store) and PostgreSQL (the shared quota store)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from sqlalchemy import func, select

from gateway.app import create_app
from gateway.config import Settings
from gateway.db import PinnedPrefix
from gateway.tenancy.quota.limits import DAILY_SPEND
from tests.conftest import ADMIN_KEY, PG_URL, away_from_minute_boundary
from tests.gateway.conftest import Gateway, fake_backends


@pytest.fixture(params=["sqlite", "postgres"])
async def make(request, tmp_path) -> AsyncIterator:
    if request.param == "postgres":
        where = {"database_url": PG_URL, "database_schema": request.getfixturevalue("pg_schema")}
    else:
        where = {"database_url": f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}"}
    started: list[Gateway] = []

    async def start(replicas: int = 1, **settings: Any) -> Gateway:
        backends = fake_backends(replicas=replicas)
        s = Settings(admin_key=ADMIN_KEY, backend="", backends=backends, **where, **settings)
        server = TestServer(create_app(s), handler_cancellation=True)
        await server.start_server()
        started.append(Gateway(server, aiohttp.ClientSession()))
        return started[-1]

    yield start
    for gw in started:
        await gw.http.close()
        await gw.server.close()


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def pin(gw: Gateway, key: str, name: str, text: str) -> tuple[int, dict, Any]:
    async with gw.http.post(
        gw.url + "/v1/prefixes",
        json={"name": name, "text": text},
        headers={"Authorization": f"Bearer {key}"},
    ) as r:
        return r.status, await r.json(), r.headers


async def admin_pin(gw: Gateway, tenant: str | None, name: str, text: str) -> tuple[int, dict]:
    body = {"tenant": tenant, "name": name, "text": text, "model": "fake-model"}
    return await gw.admin("POST", "/admin/prefixes/pins", body)


async def usage_total(gw: Gateway, tenant_id: str) -> dict:
    status, usage = await gw.admin("GET", f"/admin/usage?tenant_id={tenant_id}")
    assert status == 200, usage
    return usage["total"]


async def stored_pins(gw: Gateway) -> int:
    async with gw.state.db.session() as s:
        return await s.scalar(select(func.count()).select_from(PinnedPrefix))


def assert_openai_error(body: dict, status: int, got: int) -> None:
    assert got == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]


async def test_a_pin_past_the_tenants_tpm_is_refused_and_nothing_is_done(make) -> None:
    gw = await make()
    tenant, key = await gw.tenant("small", tpm=60)
    status, body, headers = await pin(gw, key, "big", words(100))
    assert_openai_error(body, 429, status)
    assert body["error"]["code"] == "rate_limit_exceeded" and "Retry-After" in headers
    assert "tokens per minute" in body["error"]["message"]
    assert await stored_pins(gw) == 0 and gw.state.pins.pins == {}
    assert gw.backend("fake").prefix_queries == 0  # nothing was prefilled
    assert (await usage_total(gw, tenant["id"]))["requests"] == 0
    # a pin within what is left is admitted, and settled with the tokens prefilled
    status, small, _ = await pin(gw, key, "small", words(20))
    assert status == 201 and small["replicas_warmed"] == 1, small
    assert gw.backend("fake").prefix_queries == small["tokens"]


async def test_pins_are_billed_to_their_tenant(make) -> None:
    gw = await make(replicas=2)
    tenant, key = await gw.tenant("acme", tpm=200)
    await away_from_minute_boundary()  # the tpm below counts in one minute
    status, own, _ = await pin(gw, key, "support", words(30))
    assert status == 201 and own["replicas_warmed"] == 2, own
    total = await usage_total(gw, tenant["id"])
    billed = (total["requests"], total["prompt_tokens"], total["completion_tokens"])
    assert billed == (1, 2 * own["tokens"], 0)  # prefilled on both replicas
    # an admin's pin for the tenant is not held to its rate limits, but billed to it
    status, by_admin = await admin_pin(gw, tenant["id"], "legal", words(150, "x"))
    assert status == 201 and 2 * by_admin["tokens"] > 200, by_admin
    total = await usage_total(gw, tenant["id"])
    assert total["requests"] == 2
    assert total["prompt_tokens"] == 2 * (own["tokens"] + by_admin["tokens"])
    # both counted in the tenant's minute: its own next pin is refused
    status, body, _ = await pin(gw, key, "more", words(5))
    assert_openai_error(body, 429, status)
    # a published prefix belongs to no tenant and bills none
    status, published = await admin_pin(gw, None, "house", words(10, "h"))
    assert status == 201, published
    status, everyone = await gw.admin("GET", "/admin/usage")
    assert everyone["total"]["requests"] == 2
    # prefilling the pins again at start-up is the gateway's choice: not billed
    await gw.http.close()
    await gw.server.close()
    again = await make(replicas=2)
    assert again.backend("fake-0").prefix_queries > 0  # the three pins were prefilled
    status, everyone = await again.admin("GET", "/admin/usage")
    assert everyone["total"] == total


async def test_pins_are_priced_as_input_tokens_of_their_model(make) -> None:
    """A pin's prefill is spend: its tokens on every replica at the model's input price,
    on its usage row and in the tenant's money budget. A pin no budget could hold whole
    is a 400 naming the budget, and nothing is stored or prefilled."""
    gw = await make(replicas=2, prices={"fake-model": {"input": 2.5, "output": 10}})
    tenant, key = await gw.tenant("acme", daily_spend=0.001)  # a million nanodollars
    status, own, _ = await pin(gw, key, "support", words(30))
    assert status == 201 and own["replicas_warmed"] == 2, own
    spent = 2 * own["tokens"] * 2500  # $2.5 a million tokens: 2,500 nanodollars a token
    assert (await usage_total(gw, tenant["id"]))["spend"] == spent / 1e9
    assert (await gw.state.quota.used(tenant["id"], time.time()))[DAILY_SPEND] == spent
    before = gw.backend("fake-0").prefix_queries
    status, body, _ = await pin(gw, key, "huge", words(250))  # 1.25 million nanodollars
    assert_openai_error(body, 400, status)
    assert body["error"]["code"] == "exceeds_tenant_limit"
    assert "(daily_spend)" in body["error"]["message"]
    assert "Shorten the prefix" in body["error"]["message"]
    assert await stored_pins(gw) == 1 and gw.backend("fake-0").prefix_queries == before
    # an admin's pin for the tenant is not refused by the budget, but billed to it
    status, by_admin = await admin_pin(gw, tenant["id"], "legal", words(250, "x"))
    assert status == 201, by_admin
    spent += 2 * by_admin["tokens"] * 2500
    assert (await usage_total(gw, tenant["id"]))["spend"] == spent / 1e9


async def test_the_per_tenant_caps_refuse_the_next_pin(make) -> None:
    gw = await make(max_pins_per_tenant=2, max_pin_tokens_per_tenant=100)
    tenant, key = await gw.tenant("capped")
    _, other_key = await gw.tenant("other")
    for name in ("a", "b"):
        status, body, _ = await pin(gw, key, name, words(10, name))
        assert status == 201, body
    one = body["tokens"]
    status, body, _ = await pin(gw, key, "c", words(10, "c"))
    assert_openai_error(body, 400, status)
    assert "max_pins_per_tenant is 2" in body["error"]["message"]
    assert "has 2 pinned prefixes" in body["error"]["message"]
    status, body = await admin_pin(gw, tenant["id"], "c", words(10, "c"))
    assert_openai_error(body, 400, status)  # the admin is held to the caps too
    status, body, _ = await pin(gw, other_key, "c", words(10, "c"))
    assert status == 201, body  # the caps are per tenant

    first = gw.state.pins.list(tenant["id"])[0]
    status, _ = await gw.admin("DELETE", f"/admin/prefixes/pins/{first.id}")
    assert status == 200
    status, body, _ = await pin(gw, key, "long", words(100 - one, "l"))  # one + it > 100
    assert_openai_error(body, 400, status)
    message = body["error"]["message"]
    assert "max_pin_tokens_per_tenant is 100" in message and f"hold {one} tokens" in message
    assert await stored_pins(gw) == 2 and len(gw.state.pins.list(tenant["id"])) == 1
    # refused pins are neither billed nor counted as requests
    assert (await usage_total(gw, tenant["id"]))["requests"] == 2


@pytest.mark.parametrize(
    "body",
    [
        {"name": "p", "text": "before\x00after"},
        {"name": "p\x00", "text": "x"},
        {"name": "p\x07", "text": "x"},
        {"name": "p", "text": "x", "model": "fake-model\x00"},
    ],
    ids=["nul-text", "nul-name", "bell-name", "nul-model"],
)
async def test_control_characters_in_a_pin_get_a_400(make, body) -> None:
    gw = await make()
    tenant, key = await gw.tenant("acme")
    async with gw.http.post(
        gw.url + "/v1/prefixes", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        assert_openai_error(await r.json(), 400, r.status)
    status, error = await gw.admin("POST", "/admin/prefixes/pins", body | {"tenant": tenant["id"]})
    assert_openai_error(error, 400, status)
    assert await stored_pins(gw) == 0
    # newlines and tabs are a prompt's own
    status, ok, _ = await pin(gw, key, "p", "line one\n\tline two")
    assert status == 201, ok


async def test_nul_in_the_tenant_of_an_admin_pin_gets_a_400(make) -> None:
    gw = await make()
    status, error = await admin_pin(gw, "t_\x00", "p", "x")
    assert_openai_error(error, 400, status)
    assert error["error"]["param"] == "tenant"
