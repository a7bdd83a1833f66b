"""A key change made anywhere reaches every running gateway on the database at once: the
`kvgate keys` CLI writing the database under a live `kvgate serve`, and the admin API of
one gateway under another on the same PostgreSQL. The key cache's TTL is set long, so
only the auth epoch can explain a refusal."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.tenancy.auth import EPOCH_CHECK_S
from tests.conftest import PG_URL, LiveGateway, away_from_minute_boundary, start_gateway

LONG_TTL = {"KVGATE_KEY_CACHE_TTL_S": "600"}


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[LiveGateway]:
    tmp = tmp_path_factory.mktemp("revocation")
    gw = start_gateway(tmp, "--backend", "fake", extra_env=LONG_TTL)
    yield gw
    gw.stop()


def kvgate(gw: LiveGateway, *argv: str) -> Any:
    """`kvgate ... --json` on the gateway's database, as an operator would run it."""
    cmd = [sys.executable, "-m", "gateway.cli", *argv, "--json"]
    done = subprocess.run(cmd, env=gw.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def key_id(gw: LiveGateway, tenant_id: str) -> str:
    keys = httpx.get(gw.url + f"/admin/tenants/{tenant_id}/keys", headers=gw.admin_headers)
    return keys.json()["data"][-1]["id"]


def complete(gw: LiveGateway, key: str) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    client.completions.create(model="fake-model", prompt="one two", max_tokens=2)


def test_a_key_revoked_with_the_cli_is_refused_by_the_next_request(live):
    tenant, key = live.tenant_key("acme")
    complete(live, key)  # the key is in the gateway's cache now
    assert kvgate(live, "keys", "revoke", key_id(live, tenant["id"]))["revoked_at"] is not None
    time.sleep(EPOCH_CHECK_S)  # the bound (the CLI's own start-up takes longer anyway)
    with pytest.raises(openai.AuthenticationError) as e:
        complete(live, key)
    assert "revoked" in e.value.message


def test_key_limits_set_and_changed_with_the_cli_apply_at_once(live):
    tenant, _ = live.tenant_key("globex")
    created = kvgate(live, "keys", "create", tenant["id"], "--rpm", "1", "--models", "fake-model")
    assert (created["rpm"], created["models"]) == (1, ["fake-model"])
    asyncio.run(away_from_minute_boundary())
    complete(live, created["key"])
    with pytest.raises(openai.RateLimitError) as e:
        complete(live, created["key"])
    assert "this API key's requests per minute" in e.value.message
    updated = kvgate(live, "keys", "update", created["id"], "--rpm", "2")
    assert updated["rpm"] == 2 and updated["models"] == ["fake-model"]
    time.sleep(EPOCH_CHECK_S)
    complete(live, created["key"])  # the running gateway holds it to 2 now

    cmd = [sys.executable, "-m", "gateway.cli", "keys", "update", created["id"], "--tpm", "-5"]
    done = subprocess.run(cmd, env=live.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("kvgate: --tpm: ")


@pytest.mark.pg
def test_a_revocation_on_one_gateway_reaches_another_on_postgres(tmp_path, pg_schema):
    env = {"KVGATE_DATABASE_SCHEMA": pg_schema} | LONG_TTL
    a = start_gateway(tmp_path, "--backend", "fake", database_url=PG_URL, extra_env=env)
    b = start_gateway(tmp_path, "--backend", "fake", database_url=PG_URL, extra_env=env)
    try:
        tenant, key = a.tenant_key("acme")
        complete(b, key)  # cached by b
        url = a.url + f"/admin/keys/{key_id(a, tenant['id'])}"
        assert httpx.delete(url, headers=a.admin_headers).status_code == 200
        time.sleep(EPOCH_CHECK_S)  # the bound: b has read the epoch since
        with pytest.raises(openai.AuthenticationError):
            complete(b, key)
    finally:
        a.stop()
        b.stop()
