"""A key's own default priority (issue 50): a tenant's interactive and background keys.
It only yields: a key never runs ahead of its tenant's priority; null is the tenant's."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from gateway.db.tables import ApiKey, Quota, Tenant
from gateway.tenancy.auth import principal_for


@pytest.mark.parametrize(("tenant", "key", "runs_at"), [(2, None, 2), (2, 5, 5), (2, -3, 2)])
def test_a_keys_priority_only_yields(tenant, key, runs_at) -> None:
    owner = Tenant(id="t_1", name="acme", quota=Quota(priority=tenant, weight=1.0))
    row = ApiKey(id="key_1", tenant_id="t_1", scopes=["inference"], priority=key)
    assert principal_for(row, owner).priority == runs_at


def test_keys_take_a_priority_through_the_admin_api_and_the_cli(live_gateway) -> None:
    gw = live_gateway
    with httpx.Client(base_url=gw.url, headers=gw.admin_headers, timeout=30) as http:
        tenant = http.post("/admin/tenants", json={"name": "acme", "priority": 1}).json()["id"]
        made = http.post(f"/admin/tenants/{tenant}/keys", json={"priority": 9})
        assert made.status_code == 201 and made.json()["priority"] == 9
        background = made.json()["key"]
        key_id = made.json()["id"]
        bad = http.post(f"/admin/tenants/{tenant}/keys", json={"priority": "low"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        # a background key still serves; its requests carry priority 9 to the engine
        chat = http.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {background}"},
            json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 200, chat.text
        lifted = http.patch(f"/admin/keys/{key_id}", json={"priority": None})
        assert lifted.status_code == 200 and lifted.json()["priority"] is None
    cli = [sys.executable, "-m", "gateway.cli", "keys", "update", key_id, "--priority", "4"]
    out = subprocess.run(cli, env=gw.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    with httpx.Client(base_url=gw.url, headers=gw.admin_headers, timeout=30) as http:
        assert http.get(f"/admin/keys/{key_id}").json()["priority"] == 4
