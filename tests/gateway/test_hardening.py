"""Hostile and careless request bodies (issue 13): each is refused with an OpenAI-shaped 4xx
that names the cause, and changes nothing else."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.config import Settings
from tests.conftest import ADMIN_KEY


async def _error(resp, status: int) -> dict:
    body = await resp.json()
    assert resp.status == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def _raw(gw, path: str, key: str, text: str):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return await gw.http.post(gw.url + path, data=text.encode(), headers=headers)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"user": "u" * 201}, "user"),
        ({"user": "a\x00b"}, "user"),
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"stop": [f"s{i}" for i in range(5)]}, "stop"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"n": 129}, "n"),
        ({"model": "m\x00"}, "model"),
        ({"seed": 2**63}, "seed"),
    ],
)
async def test_bad_fields_are_refused_by_name(gw, fields, param):
    _, key = await gw.tenant()
    error = await _error(await gw.chat(key, **fields), 400)
    assert error["param"].startswith(param), error


async def test_unknown_fields_are_refused_by_name_and_nulls_pass(gw):
    _, key = await gw.tenant()
    error = await _error(await gw.chat(key, prediction={"type": "content"}, functions=[]), 400)
    assert "'prediction'" in error["message"] and "'functions'" in error["message"]
    r = await gw.chat(key, max_tokens=2, prediction=None)
    assert r.status == 200, await r.text()


@pytest.mark.parametrize(
    "logit_bias",
    [
        {"abc": 1},
        {"-1": 1},
        {"+5": 1},
        {" 5": 1},
        {"": 1},
        {"\u0665": 1},  # a digit, not an ASCII one
        {str(2**31): 1},
        {"9" * 5000: 1},  # past what int() converts
        {"5": 101},
        {"5": -100.5},
        {"5": "1"},
        {"5": None},
        {str(i): 1 for i in range(1025)},
        [[5, 1]],  # engine_api's pairs are not the HTTP form
    ],
)
async def test_bad_logit_bias_is_refused_by_name(gw, logit_bias):
    _, key = await gw.tenant()
    for r in (
        await gw.chat(key, max_tokens=1, logit_bias=logit_bias),
        await gw.post(
            "/v1/completions",
            key,
            {"model": "fake-model", "prompt": "hi", "max_tokens": 1, "logit_bias": logit_bias},
        ),
    ):
        error = await _error(r, 400)
        assert error["param"].startswith("logit_bias"), error
        assert "logit_bias" in error["message"], error


async def test_logit_bias_at_its_limits_is_accepted(gw):
    _, key = await gw.tenant()
    edges = {str(i): (-100, 100)[i % 2] for i in range(2**31 - 1024, 2**31)}
    for logit_bias in ({}, {"0": 0.5}, edges):
        r = await gw.chat(key, max_tokens=1, logit_bias=logit_bias)
        assert r.status == 200, await r.text()


async def test_infinity_is_not_a_number(gw):
    _, key = await gw.tenant()
    body = '{"model": "fake-model", "prompt": "hi", "temperature": Infinity}'
    await _error(await _raw(gw, "/v1/completions", key, body), 400)
    r = await _raw(gw, "/admin/tenants", ADMIN_KEY, '{"name": "inf", "weight": Infinity}')
    assert (await _error(r, 400))["param"] == "weight"


async def test_fan_out_is_capped_before_anything_is_built(gw):
    _, key = await gw.tenant()
    prompts = ["word"] * 129
    body = {"model": "fake-model", "prompt": prompts, "max_tokens": 1}
    await _error(await gw.post("/v1/completions", key, body), 400)
    body = {"model": "fake-model", "prompt": ["a", "b", "c"], "n": 50, "max_tokens": 1}
    error = await _error(await gw.post("/v1/completions", key, body), 400)
    assert "150 choices" in error["message"]
    assert gw.backend("fake").running == 0


async def test_each_choice_counts_against_the_request_quota(gw):
    tenant, key = await gw.tenant(rpm=4)
    body = {"model": "fake-model", "prompt": ["a b", "c d"], "n": 2, "max_tokens": 2}
    r = await gw.post("/v1/completions", key, body)
    assert r.status == 200 and len((await r.json())["choices"]) == 4
    r = await gw.post("/v1/completions", key, body | {"n": 1, "prompt": "one"})
    await _error(r, 429)
    usage = await gw.state.quota.used(tenant["id"], time.time())
    assert usage["concurrent"] == 0


async def test_more_choices_than_a_limit_can_ever_admit_is_a_400(gw):
    _, key = await gw.tenant(rpm=100, max_concurrent=3)
    error = await _error(await gw.chat(key, n=4, max_tokens=1), 400)
    assert error["code"] == "exceeds_tenant_limit" and "max_concurrent" in error["message"]
    r = await gw.chat(key, n=3, max_tokens=1)
    assert r.status == 200


async def test_without_max_tokens_a_small_tpm_reserves_what_fits(gw):
    tenant, key = await gw.tenant(tpm=1000)
    r = await gw.chat(key, "a short question")
    assert r.status == 200, await r.text()
    usage = (await r.json())["usage"]
    assert usage["total_tokens"] <= 1000
    assert r.headers["x-ratelimit-limit-tokens"] == "1000"


async def test_a_request_larger_than_the_token_limit_is_a_400_not_a_429(gw):
    _, key = await gw.tenant(tpm=1000)
    error = await _error(await gw.chat(key, max_tokens=2000), 400)
    assert error["code"] == "exceeds_tenant_limit" and "tpm" in error["message"]
    _, tiny = await gw.tenant("tiny", daily_tokens=3)
    error = await _error(await gw.chat(tiny, "many words in this prompt"), 400)
    assert "daily_tokens" in error["message"]


@pytest.mark.parametrize(
    "fields",
    [
        {"rpm": 2**31},
        {"tpm": 10**20},
        {"daily_tokens": -1},
        {"name": "a\x00b"},
        {"name": "x" * 201},
        {"priority": 2**40},
        {"weight": 0},
        {"models": ["m\x00"]},
        {"rpm": "5"},
        {"color": "blue"},
    ],
)
async def test_tenant_fields_out_of_bounds_are_400(gw, fields):
    status, body = await gw.admin("POST", "/admin/tenants", {"name": "t"} | fields)
    assert status == 400, body
    status, body = await gw.admin("GET", "/admin/tenants")
    assert body["data"] == []


async def test_tenant_update_null_lifts_a_limit(gw):
    tenant, _ = await gw.tenant(rpm=5)
    status, body = await gw.admin("PATCH", f"/admin/tenants/{tenant['id']}", {"rpm": None})
    assert status == 200 and body["rpm"] is None


async def test_control_characters_in_the_url_are_400(gw):
    status, body = await gw.admin("GET", "/admin/tenants/a%00b")
    assert status == 400 and body["error"]["message"]
    status, body = await gw.admin("GET", "/admin/usage?since=%00")
    assert status == 400


async def test_non_utf8_authorization_is_401(gw):
    reader, writer = await asyncio.open_connection(gw.server.host, gw.server.port)
    writer.write(
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer kvg-\xff\xfe\x80\r\n"
        b"Connection: close\r\n\r\n"
    )
    await writer.drain()
    response = await reader.read()
    writer.close()
    assert response.startswith(b"HTTP/1.1 401"), response[:200]
    assert b'"authentication_error"' in response


def test_weak_admin_key_is_refused():
    with pytest.raises(ValueError, match="at least 32"):
        Settings(admin_key="short")
    with pytest.raises(ValueError, match="at least 32"):
        Settings(metrics_token="short")


@pytest.mark.parametrize("query", ["since=yesterday", "until=2026-13-01", "since=20260101"])
async def test_usage_dates_must_be_days(gw, query):
    status, body = await gw.admin("GET", f"/admin/usage?{query}")
    assert status == 400 and body["error"]["param"] == query.split("=")[0]
    status, body = await gw.admin("GET", "/admin/usage?since=2026-01-01&until=2026-12-31")
    assert status == 200


async def test_min_tokens_above_max_tokens_is_400_and_reserves_nothing(gw):
    tenant, key = await gw.tenant(rpm=10)
    error = await _error(await gw.chat(key, max_tokens=2, min_tokens=5), 400)
    assert error["param"] == "min_tokens"
    assert (await gw.state.quota.used(tenant["id"], time.time()))["requests"] == 0
