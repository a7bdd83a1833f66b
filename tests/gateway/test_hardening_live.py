"""Issue 13's reproductions against a real `kvgate serve` process: values PostgreSQL cannot
hold give 4xx (they gave 500), a restart keeps the minute windows, and a weak admin key
does not start a gateway."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest

from tests.conftest import PG_URL, away_from_minute_boundary, start_gateway

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _hostile_requests(gw) -> list[httpx.Response]:
    _, key = gw.tenant_key("victim")
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        admin, tenant = gw.admin_headers, {"Authorization": f"Bearer {key}"}
        return [
            http.post("/admin/tenants", json={"name": "nul\x00name"}, headers=admin),
            http.post("/admin/tenants", json={"name": "big", "rpm": 2**31}, headers=admin),
            http.post("/admin/tenants", json={"name": "huge", "tpm": 10**20}, headers=admin),
            http.get("/admin/tenants/t_%00", headers=admin),
            http.get("/admin/usage", params={"since": "\x00"}, headers=admin),
            http.post("/v1/chat/completions", json=CHAT | {"user": "u\x00"}, headers=tenant),
            http.post("/v1/chat/completions", json=CHAT | {"user": "u" * 300}, headers=tenant),
            http.post("/v1/prefixes", json={"name": "p", "text": "a\x00b"}, headers=tenant),
        ]


@pytest.mark.pg
def test_values_postgres_cannot_hold_are_4xx(tmp_path, pg_schema):
    env = {"KVGATE_DATABASE_SCHEMA": pg_schema}
    gw = start_gateway(tmp_path, "--backend", "fake", database_url=PG_URL, extra_env=env)
    try:
        for r in _hostile_requests(gw):
            assert 400 <= r.status_code < 500, (r.request.url, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        with httpx.Client(base_url=gw.url, headers=gw.admin_headers) as http:
            names = [t["name"] for t in http.get("/admin/tenants").json()["data"]]
        assert names == ["victim"]
    finally:
        gw.stop()
    assert "Traceback" not in gw.log.read_text()


def test_a_restart_keeps_the_minute_window(tmp_path):
    gw = start_gateway(tmp_path, "--backend", "fake")
    try:
        _, key = gw.tenant_key("steady", rpm=3)
        asyncio.run(away_from_minute_boundary(margin_s=25))
        headers = {"Authorization": f"Bearer {key}"}
        statuses = [
            httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers).status_code
            for _ in range(3)
        ]
        assert statuses == [200, 200, 200]
    finally:
        gw.stop()
    again = start_gateway(tmp_path, "--backend", "fake")
    try:
        r = httpx.post(again.url + "/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        again.stop()


def test_a_weak_admin_key_does_not_start(tmp_path):
    env = dict(os.environ) | {"KVGATE_ADMIN_KEY": "admin"}
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--backend", "fake", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "at least 32 characters" in out.stderr
