"""A key's own limits over HTTP: set in the body that makes the key, read back, changed
with a PATCH, enforced beside the tenant's (the stricter refusing, and the 429 saying
whose), its models narrowing the tenant's, and its committed usage reloaded on restart."""

from __future__ import annotations

import time

import openai
import pytest
from openai import AsyncOpenAI

from tests.conftest import away_from_minute_boundary


def client(gw, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def new_key(gw, tenant_id: str, **body) -> dict:
    status, key = await gw.admin("POST", f"/admin/tenants/{tenant_id}/keys", body)
    assert status == 201, key
    return key


async def complete(c: AsyncOpenAI, model: str = "fake-model"):
    return await c.completions.create(model=model, prompt="one two three", max_tokens=2)


async def test_a_keys_rpm_is_enforced_and_a_patch_changes_it(gw):
    tenant, _ = await gw.tenant(rpm=100)
    key = await new_key(gw, tenant["id"], name="batch", rpm=2)
    assert (key["rpm"], key["tpm"], key["models"]) == (2, None, None)
    status, listed = await gw.admin("GET", f"/admin/tenants/{tenant['id']}/keys")
    assert status == 200 and [k["rpm"] for k in listed["data"]] == [None, 2]
    c = client(gw, key["key"])
    await away_from_minute_boundary()
    for _ in range(2):
        await complete(c)
    with pytest.raises(openai.RateLimitError) as e:
        await complete(c)
    assert "this API key's requests per minute" in e.value.message
    assert e.value.response.headers["x-ratelimit-limit-requests"] == "2"

    status, patched = await gw.admin("PATCH", f"/admin/keys/{key['id']}", {"rpm": 4})
    assert status == 200 and patched["rpm"] == 4 and patched["name"] == "batch"
    status, got = await gw.admin("GET", f"/admin/keys/{key['id']}")
    assert status == 200 and got == patched
    for _ in range(2):  # the minute's two count: two more fit under four
        done = await c.completions.with_raw_response.create(
            model="fake-model", prompt="one two three", max_tokens=2
        )
    assert done.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError):
        await complete(c)
    status, lifted = await gw.admin("PATCH", f"/admin/keys/{key['id']}", {"rpm": None})
    assert status == 200 and lifted["rpm"] is None
    await complete(c)  # the tenant's 100 alone now


async def test_the_tenants_stricter_limit_refuses_and_says_so(gw):
    tenant, _ = await gw.tenant(rpm=1)
    key = await new_key(gw, tenant["id"], rpm=5)
    c = client(gw, key["key"])
    await away_from_minute_boundary()
    await complete(c)
    with pytest.raises(openai.RateLimitError) as e:
        await complete(c)
    assert "your tenant's requests per minute" in e.value.message


async def test_a_keys_token_budget_caps_max_tokens_and_refuses(gw):
    tenant, _ = await gw.tenant()
    key = await new_key(gw, tenant["id"], daily_tokens=40)
    c = client(gw, key["key"])
    # no max_tokens: the reservation is capped by the key's budget, as by a tenant's
    done = await c.completions.create(model="fake-model", prompt="one two three")
    assert done.usage.total_tokens == 40
    with pytest.raises(openai.RateLimitError) as e:
        await complete(c)
    assert "this API key's tokens per day" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # never admissible: 400, not 429
        await c.completions.create(model="fake-model", prompt="a " * 41, max_tokens=1)
    assert e.value.code == "exceeds_tenant_limit"


async def test_a_keys_models_narrow_the_tenants(gw):
    tenant, _ = await gw.tenant(models=["fake-model", "other-model"])
    key = await new_key(gw, tenant["id"], models=["other-model"])
    c = client(gw, key["key"])
    assert [m.id async for m in c.models.list()] == []  # other-model is not served here
    with pytest.raises(openai.PermissionDeniedError) as e:
        await complete(c)
    assert e.value.code == "model_not_allowed"
    status, _ = await gw.admin("PATCH", f"/admin/keys/{key['id']}", {"models": ["fake-model"]})
    assert status == 200
    assert [m.id async for m in c.models.list()] == ["fake-model"]
    await complete(c)
    await gw.admin("PATCH", f"/admin/tenants/{tenant['id']}", {"models": ["other-model"]})
    with pytest.raises(openai.PermissionDeniedError):  # both must allow it
        await complete(c)


async def test_key_bodies_are_checked_and_keys_stay_with_their_tenant(gw):
    tenant, own_key = await gw.tenant()
    other, _ = await gw.tenant("globex")
    path = f"/admin/tenants/{tenant['id']}/keys"
    for body, param in (({"rpm": -1}, "rpm"), ({"tpm": "5"}, "tpm"), ({"rpx": 5}, "rpx")):
        status, error = await gw.admin("POST", path, body)
        assert status == 400 and param in error["error"]["message"], body
    key = await new_key(gw, other["id"], tpm=1000)
    # a tenant's share (its weight) is not a key's to have
    status, error = await gw.admin("PATCH", f"/admin/keys/{key['id']}", {"weight": 2})
    assert status == 400 and "weight" in error["error"]["message"]
    status, unnamed = await gw.admin("PATCH", f"/admin/keys/{key['id']}", {"name": None})
    assert status == 200 and unnamed["name"] == "" and unnamed["tpm"] == 1000
    status, _ = await gw.admin("PATCH", "/admin/keys/key_nonexistent", {"rpm": 1})
    assert status == 404
    admin_key = next(k for k in await gw.state.tenants.list_keys() if k["tenant_id"] is None)
    status, error = await gw.admin("PATCH", f"/admin/keys/{admin_key['id']}", {"rpm": 1})
    assert status == 400 and "admin key" in error["error"]["message"]

    headers = {"Authorization": f"Bearer {own_key}"}
    async with gw.http.get(gw.url + f"/admin/keys/{key['id']}", headers=headers) as r:
        assert r.status == 404  # another tenant's key is not even confirmed
    (mine,) = await gw.state.tenants.list_keys(tenant["id"])
    url = gw.url + f"/admin/keys/{mine['id']}"
    async with gw.http.get(url, headers=headers) as r:
        assert r.status == 200 and (await r.json())["id"] == mine["id"]
    async with gw.http.patch(url, json={"rpm": 1000}, headers=headers) as r:
        assert r.status == 403  # a tenant does not lift its own key's limits


async def test_a_keys_committed_usage_is_reloaded_on_restart(gw):
    tenant, _ = await gw.tenant()
    key = await new_key(gw, tenant["id"], daily_tokens=1000)
    unlimited = await new_key(gw, tenant["id"])
    await away_from_minute_boundary()
    await complete(client(gw, key["key"]))
    await complete(client(gw, unlimited["key"]))
    now = time.time()
    used = await gw.state.tenants.committed_usage(now)
    assert used[key["id"]] == {"monthly": 5, "daily": 5, "tokens": 5, "requests": 1} | {
        "daily_spend": 0,  # the model has no price
        "monthly_spend": 0,
    }
    assert used[tenant["id"]]["daily"] == 10
    assert unlimited["id"] not in used  # it has no counters to seed
