"""Bad input and faults: each gets its OpenAI-shaped error, never a 500, and none
leaves a quota slot held."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.backends import BackendSpec
from tests.gateway.conftest import fake_backends


async def _error(resp, status: int) -> dict:
    body = await resp.json()
    assert resp.status == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def _slot_is_free(gw, key: str) -> None:
    # The tenant allows one request at a time: a good request must still get through.
    r = await gw.chat(key, "still fine", max_tokens=2)
    assert r.status == 200, await r.text()


async def test_invalid_json_and_schema(gw):
    _, key = await gw.tenant(max_concurrent=1)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    r = await gw.http.post(gw.url + "/v1/chat/completions", data=b"{not json", headers=headers)
    assert "not valid JSON" in (await _error(r, 400))["message"]
    r = await gw.post("/v1/chat/completions", key, {"model": "fake-model"})
    assert (await _error(r, 400))["param"] == "messages"
    r = await gw.chat(key, "x", temperature=5)
    assert (await _error(r, 400))["param"] == "temperature"
    r = await gw.chat(key, "x", max_tokens=0)
    await _error(r, 400)
    await _slot_is_free(gw, key)


@pytest.mark.parametrize("header", [None, "Bearer", "Bearer kvg-nope", "Basic abc"])
async def test_missing_or_unknown_key(gw, header):
    headers = {"Authorization": header} if header else {}
    r = await gw.http.post(gw.url + "/v1/chat/completions", json={}, headers=headers)
    assert (await _error(r, 401))["type"] == "authentication_error"


async def test_revoked_and_expired_keys(gw):
    tenant, key = await gw.tenant()
    assert (await gw.chat(key, "x", max_tokens=1)).status == 200
    keys = (await gw.admin("GET", f"/admin/tenants/{tenant['id']}/keys"))[1]["data"]
    status, _ = await gw.admin("DELETE", f"/admin/keys/{keys[0]['id']}")
    assert status == 200
    assert "revoked" in (await _error(await gw.chat(key, "x", max_tokens=1), 401))["message"]

    path = f"/admin/tenants/{tenant['id']}/keys"
    status, body = await gw.admin("POST", path, {"expires_at": time.time() - 1})
    assert status == 400 and body["error"]["param"] == "expires_at"  # it could never work
    status, short = await gw.admin("POST", path, {"expires_in_s": 0.5})
    assert status == 201
    await asyncio.sleep(0.6)
    r = await gw.chat(short["key"], "x", max_tokens=1)
    assert "expired" in (await _error(r, 401))["message"]


async def test_model_not_allowed_and_unknown(gw):
    _, key = await gw.tenant(models=["some-other-model"], max_concurrent=1)
    assert (await _error(await gw.chat(key, "x"), 403))["code"] == "model_not_allowed"
    _, key = await gw.tenant("t2", max_concurrent=1)
    r = await gw.chat(key, "x", model="no-such-model")
    err = await _error(r, 404)
    assert err["code"] == "model_not_found"
    assert "Available: fake-model." in err["message"]
    await _slot_is_free(gw, key)


async def test_body_over_4_mib(gw):
    _, key = await gw.tenant(max_concurrent=1)
    r = await gw.chat(key, "word " * (1024 * 1024))
    await _error(r, 413)
    await _slot_is_free(gw, key)


async def test_prompt_longer_than_context_names_both_lengths(make_gateway):
    gw = await make_gateway(fake_backends(context_length=64))
    _, key = await gw.tenant(max_concurrent=1)
    body = {"model": "fake-model", "prompt": "w " * 100, "max_tokens": 10}
    r = await gw.post("/v1/completions", key, body)
    err = await _error(r, 400)
    assert err["code"] == "context_length_exceeded"
    assert "64" in err["message"] and "100" in err["message"]
    await _slot_is_free(gw, key)


async def test_backend_down_is_503_and_others_keep_serving(make_gateway):
    broken = BackendSpec("broken", "fake", "", "broken-model", {"down": True})
    gw = await make_gateway([broken, BackendSpec("fake", "fake", "", "fake-model")])
    _, key = await gw.tenant(max_concurrent=1)
    r = await gw.chat(key, "x", model="broken-model")
    await _error(r, 503)
    r = await gw.chat(key, "x", model="broken-model", stream=True)
    assert r.status in (200, 503)  # either refused up front or an error event in the stream
    await _slot_is_free(gw, key)
    async with gw.http.get(gw.url + "/ready") as r:
        assert (await r.json())["backends"] == {"broken": False, "fake": True}


async def test_backend_failing_mid_request_is_503_with_usage_row(make_gateway):
    gw = await make_gateway(fake_backends(fail_rate=1.0))
    _, key = await gw.tenant(max_concurrent=1)
    await _error(await gw.chat(key, "x", max_tokens=3), 503)
    status, usage = await gw.admin("GET", "/admin/usage")
    assert usage["total"]["requests"] == 1 and usage["total"]["completion_tokens"] == 0
    gw.backend("fake").fail_rate = 0
    await _slot_is_free(gw, key)


async def test_unknown_route_and_method_are_openai_shaped(gw):
    async with gw.http.get(gw.url + "/v1/nothing") as r:
        await _error(r, 404)
    async with gw.http.get(gw.url + "/v1/chat/completions") as r:
        await _error(r, 405)
