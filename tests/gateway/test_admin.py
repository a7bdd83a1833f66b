"""The admin API: tenants, keys, usage, stats; and tenant isolation."""

from __future__ import annotations

from tests.conftest import ADMIN_KEY


async def test_tenant_crud(gw):
    acme = {"name": "acme", "rpm": 10, "models": ["fake-model"]}
    status, t = await gw.admin("POST", "/admin/tenants", acme)
    assert status == 201 and t["id"].startswith("t_")
    assert t["rpm"] == 10 and t["tpm"] is None and t["models"] == ["fake-model"]
    status, _ = await gw.admin("POST", "/admin/tenants", {"name": "acme"})
    assert status == 409
    status, t2 = await gw.admin("PATCH", f"/admin/tenants/{t['id']}", {"tpm": 1000, "rpm": None})
    assert (
        status == 200 and t2["tpm"] == 1000 and t2["rpm"] is None and t2["models"] == ["fake-model"]
    )
    status, listed = await gw.admin("GET", "/admin/tenants")
    assert [x["name"] for x in listed["data"]] == ["acme"]
    status, _ = await gw.admin("POST", "/admin/tenants", {"name": "bad", "rpm": -1})
    assert status == 400
    status, _ = await gw.admin("POST", "/admin/tenants", {"name": "bad", "surprise": 1})
    assert status == 400
    status, _ = await gw.admin("DELETE", f"/admin/tenants/{t['id']}")
    assert status == 200
    status, _ = await gw.admin("GET", f"/admin/tenants/{t['id']}")
    assert status == 404


async def test_quota_update_applies_at_once(gw):
    t, key = await gw.tenant(rpm=1)
    assert (await gw.chat(key, "x", max_tokens=1)).status == 200
    assert (await gw.chat(key, "x", max_tokens=1)).status == 429
    await gw.admin("PATCH", f"/admin/tenants/{t['id']}", {"rpm": 100})
    assert (await gw.chat(key, "x", max_tokens=1)).status == 200


async def test_key_is_shown_once_and_stored_hashed(gw):
    t, key = await gw.tenant()
    assert key.startswith("kvg-") and len(key) >= 4 + 43
    _, keys = await gw.admin("GET", f"/admin/tenants/{t['id']}/keys")
    (record,) = keys["data"]
    assert "key" not in record and record["prefix"] == key[:12]
    from sqlalchemy import select

    from gateway.db import ApiKey
    from gateway.tenancy.auth import hash_key

    async with gw.state.db.session() as s:
        stored = await s.scalar(select(ApiKey).where(ApiKey.id == record["id"]))
    assert stored.key_hash == hash_key(key) and key not in stored.key_hash


async def test_deleting_a_tenant_disables_its_keys(gw):
    t, key = await gw.tenant()
    await gw.admin("DELETE", f"/admin/tenants/{t['id']}")
    assert (await gw.chat(key, "x")).status == 401


async def test_tenant_key_never_reads_another_tenant(gw):
    a, key_a = await gw.tenant("a")
    b, key_b = await gw.tenant("b")
    await gw.chat(key_a, "from a", max_tokens=2)
    await gw.chat(key_b, "from b", max_tokens=3)
    auth = {"Authorization": f"Bearer {key_a}"}

    async def get(path):
        async with gw.http.get(gw.url + path, headers=auth) as r:
            return r.status, await r.json()

    assert (await get(f"/admin/tenants/{a['id']}"))[0] == 200
    assert (await get(f"/admin/tenants/{b['id']}"))[0] == 404
    assert (await get(f"/admin/tenants/{b['id']}/keys"))[0] == 404
    assert (await get("/admin/tenants"))[0] == 403
    assert (await get("/admin/stats"))[0] == 403
    status, usage = await get("/admin/usage")
    assert status == 200 and {d["tenant_id"] for d in usage["data"]} == {a["id"]}
    assert (await get(f"/admin/usage?tenant_id={b['id']}"))[0] == 404
    b_keys = gw.url + f"/admin/tenants/{b['id']}/keys"
    async with gw.http.post(b_keys, json={}, headers=auth) as r:
        assert r.status == 403


async def test_admin_key_cannot_do_inference(gw):
    r = await gw.chat(ADMIN_KEY, "x")
    assert r.status == 403


async def test_usage_and_stats(gw):
    t, key = await gw.tenant("stats", rpm=100)
    for _ in range(3):
        assert (await gw.chat(key, "a b c", max_tokens=4)).status == 200
    _, usage = await gw.admin("GET", "/admin/usage")
    assert usage["total"]["requests"] == 3 and usage["total"]["completion_tokens"] == 12
    (row,) = usage["data"]
    assert row["tenant_id"] == t["id"] and row["model"] == "fake-model"
    status, snap = await gw.admin("GET", "/admin/stats")
    assert status == 200
    assert snap["totals"]["requests"] == 3 and snap["totals"]["completion_tokens"] == 12
    (tenant,) = snap["tenants"]
    assert tenant["name"] == "stats" and tenant["quota"]["rpm"] == 100
    assert tenant["quota"]["rpm_used"] == 3
    # No price for the model: no spend, and no money budget set.
    spend = {k: v for k, v in tenant["quota"].items() if "spend" in k}
    assert spend == {
        "daily_spend": None,
        "daily_spend_used": 0.0,
        "monthly_spend": None,
        "monthly_spend_used": 0.0,
    }
    assert snap["backends"][0]["name"] == "fake" and snap["backends"][0]["healthy"]
    assert snap["latency"]["e2e_p50_ms"] is not None
    assert snap["rates"]["output_tokens_per_s"] > 0


async def test_stats_stream(gw):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with gw.http.get(gw.url + "/admin/stats/stream?interval=0.1", headers=admin) as r:
        assert r.status == 200
        lines = []
        async for line in r.content:
            if line.startswith(b"data: "):
                lines.append(line)
            if len(lines) == 2:
                break
    assert all(b'"totals"' in line for line in lines)
