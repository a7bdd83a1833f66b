"""The audit log: every kind of admin change (a config reload too) leaves exactly one row
naming the admin key by its id, with the object before and after, and no secret; a change
that fails leaves none; GET /admin/audit's filters and pages; `kvgate audit`; SQLite and
PostgreSQL; and migration 0011 carrying the old rows over."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import aiohttp
import pytest
from sqlalchemy import select, text

from gateway.app import create_app
from gateway.cli import main as kvgate
from gateway.config_load import ConfigSource
from gateway.db import ApiKey, Database, migrate
from gateway.http.server import GatewayTestServer
from gateway.reload import SIGNAL_ACTOR, reload_on_signal
from gateway.tenancy.auth import hash_key
from tests.conftest import ADMIN_KEY, PG_URL
from tests.gateway.conftest import Gateway

PIN_TEXT = "You are the support agent of Acme. Answer in one short paragraph."


async def admin_key_id(gw) -> str:
    async with gw.state.db.session() as s:
        return await s.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_key(ADMIN_KEY)))


class Log:
    """The audit rows through GET /admin/audit; `new()` gives those since the last call."""

    def __init__(self, gw) -> None:
        self.gw = gw
        self.seen = 0

    async def new(self) -> list[dict[str, Any]]:
        status, page = await self.gw.admin("GET", "/admin/audit?limit=1000")
        assert status == 200, page
        rows = [r for r in reversed(page["data"]) if r["id"] > self.seen]
        if rows:
            self.seen = rows[-1]["id"]
        return rows


async def one_change(log: Log, action: str, target: str) -> dict[str, Any]:
    rows = await log.new()
    assert [(r["action"], r["target"]) for r in rows] == [(action, target)], rows
    return rows[0]


async def every_kind_of_change(gw, adapter_dir: str) -> list[str]:
    """Each admin change once, each checked for its one row; the secrets it handled."""
    log, actor = Log(gw), await admin_key_id(gw)
    await log.new()  # the bootstrap admin key's row
    t, k, secrets = await tenant_and_key_changes(gw, log, actor)
    secrets += await pin_and_adapter_changes(gw, log, t, adapter_dir)
    # refused changes write nothing: a name taken, an unknown tenant
    assert (await gw.admin("POST", "/admin/tenants", {"name": "acme"}))[0] == 409
    assert (await gw.admin("POST", "/admin/tenants/t_nope/keys", {}))[0] == 404
    assert (await gw.admin("PATCH", "/admin/tenants/t_nope", {"rpm": 1}))[0] == 404
    assert await log.new() == []

    status, _ = await gw.admin("DELETE", f"/admin/tenants/{t['id']}")
    row = await one_change(log, "tenant.delete", t["id"])
    assert row["before"]["name"] == "acme" and row["before"]["key_ids"] == [k["id"]]
    assert row["after"] is None and row["actor"] == actor
    return [ADMIN_KEY, *secrets]


async def tenant_and_key_changes(gw, log: Log, actor: str) -> tuple[dict, dict, list[str]]:
    status, t = await gw.admin("POST", "/admin/tenants", {"name": "acme", "rpm": 10})
    assert status == 201
    row = await one_change(log, "tenant.create", t["id"])
    assert row["actor"] == actor and row["tenant_id"] == t["id"]
    assert row["before"] is None and row["after"] == t

    body = {"rpm": 20, "daily_spend": 5.0}
    status, t2 = await gw.admin("PATCH", f"/admin/tenants/{t['id']}", body)
    row = await one_change(log, "tenant.update", t["id"])
    assert row["before"] == t and row["after"] == t2
    assert (row["before"]["rpm"], row["after"]["rpm"]) == (10, 20)
    assert (row["before"]["daily_spend"], row["after"]["daily_spend"]) == (None, 5.0)

    status, k = await gw.admin("POST", f"/admin/tenants/{t['id']}/keys", {"name": "app", "tpm": 9})
    assert status == 201
    record = {f: v for f, v in k.items() if f != "key"}
    row = await one_change(log, "key.create", k["id"])
    assert row["before"] is None and row["after"] == record and row["tenant_id"] == t["id"]

    status, k2 = await gw.admin("PATCH", f"/admin/keys/{k['id']}", {"tpm": None, "rpm": 5})
    row = await one_change(log, "key.update", k["id"])
    assert row["before"] == record and row["after"] == k2 and row["after"]["tpm"] is None

    status, k3 = await gw.admin("DELETE", f"/admin/keys/{k['id']}")
    row = await one_change(log, "key.revoke", k["id"])
    assert row["before"]["revoked_at"] is None and row["after"] == k3
    await gw.admin("DELETE", f"/admin/keys/{k['id']}")  # already revoked: no change
    assert await log.new() == []
    return t, k, [k["key"], hash_key(k["key"])]


async def pin_and_adapter_changes(gw, log: Log, t: dict, adapter_dir: str) -> list[str]:
    pin = {"tenant": t["id"], "name": "support", "text": PIN_TEXT, "model": "fake-model"}
    status, p = await gw.admin("POST", "/admin/prefixes/pins", pin)
    assert status == 201, p
    row = await one_change(log, "prefix.pin", p["id"])
    assert row["after"]["name"] == "support" and row["tenant_id"] == t["id"]
    assert row["after"]["text"]["chars"] == len(PIN_TEXT)  # its digest, not the prompt
    await gw.admin("DELETE", f"/admin/prefixes/pins/{p['id']}")
    row = await one_change(log, "prefix.unpin", p["id"])
    assert row["before"]["name"] == "support" and row["after"] is None

    body = {"name": "sql-lora", "path": adapter_dir, "base_model": "fake-model", "tenant": "acme"}
    status, a = await gw.admin("POST", "/admin/adapters", body)
    assert status == 201, a
    row = await one_change(log, "adapter.create", "sql-lora")
    stored = {k: v for k, v in a.items() if k not in ("state", "error")}  # not its health
    assert row["after"] == stored and row["tenant_id"] == t["id"]
    await gw.admin("DELETE", "/admin/adapters/sql-lora")
    row = await one_change(log, "adapter.delete", "sql-lora")
    assert row["before"] == stored and row["after"] is None
    return [PIN_TEXT]


async def assert_no_secret_in_any_row(db: Database, secrets: list[str]) -> None:
    async with db.engine.connect() as conn:
        rows = (await conn.execute(text("SELECT * FROM audit_log"))).all()
    dump = json.dumps([list(map(str, r)) for r in rows])
    assert len(rows) == 11  # the bootstrap admin key and ten changes
    for secret in secrets:
        assert secret not in dump


@pytest.fixture
def adapter_dir(tmp_path) -> str:
    path = tmp_path / "sql-lora"
    path.mkdir()
    return str(path)


async def test_every_admin_change_is_one_row_without_a_secret(gw, adapter_dir):
    secrets = await every_kind_of_change(gw, adapter_dir)
    await assert_no_secret_in_any_row(gw.state.db, secrets)


@pytest.mark.pg
async def test_every_admin_change_is_one_row_on_postgresql(pg_schema, make_gateway, adapter_dir):
    gw = await make_gateway(database_url=PG_URL, database_schema=pg_schema)
    secrets = await every_kind_of_change(gw, adapter_dir)
    await assert_no_secret_in_any_row(gw.state.db, secrets)
    status, page = await gw.admin("GET", "/admin/audit?action=key&limit=2")
    assert [r["action"] for r in page["data"]] == ["key.revoke", "key.update"]
    status, rest = await gw.admin("GET", f"/admin/audit?action=key&cursor={page['next_cursor']}")
    assert [r["action"] for r in rest["data"]] == ["key.create", "key.create"]  # and bootstrap


async def test_filters_and_pages(gw):
    a, _ = await gw.tenant("a")
    b, _ = await gw.tenant("b")
    middle = time.time()
    await gw.admin("PATCH", f"/admin/tenants/{a['id']}", {"rpm": 1})

    async def get(query: str) -> tuple[int, Any]:
        return await gw.admin("GET", "/admin/audit?" + query)

    _, rows = await get(f"tenant_id={a['id']}")
    assert [r["action"] for r in rows["data"]] == ["tenant.update", "key.create", "tenant.create"]
    _, rows = await get(f"target={b['id']}")
    assert [r["action"] for r in rows["data"]] == ["tenant.create"]
    _, rows = await get("action=tenant.update")
    assert [r["target"] for r in rows["data"]] == [a["id"]]
    _, rows = await get("action=key")  # the family: key.*, the bootstrap admin key's too
    assert len(rows["data"]) == 3 and {r["action"] for r in rows["data"]} == {"key.create"}
    _, rows = await get(f"since={middle}")
    assert [r["action"] for r in rows["data"]] == ["tenant.update"]
    _, rows = await get(f"until={middle}")
    assert "tenant.update" not in [r["action"] for r in rows["data"]] and len(rows["data"]) == 5
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(middle + 3600))
    assert (await get(f"since={iso}"))[1]["data"] == []  # ISO 8601, UTC

    _, everything = await get("limit=1000")
    seen, cursor = [], ""
    while True:  # two at a time, newest first, each row once
        _, page = await get("limit=2" + cursor)
        seen += [r["id"] for r in page["data"]]
        if page["next_cursor"] is None:
            break
        cursor = f"&cursor={page['next_cursor']}"
    assert seen == [r["id"] for r in everything["data"]] and len(seen) == 6

    for query, param in [
        ("limit=0", "limit"),
        ("limit=abc", "limit"),
        ("since=yesterday", "since"),
        ("cursor=-1", "cursor"),
        (f"cursor={2**64}", "cursor"),
        ("surprise=1", "surprise"),
    ]:
        status, error = await get(query)
        assert status == 400 and error["error"]["param"] == param, (query, error)


async def test_only_an_admin_key_reads_the_log(gw):
    _, key = await gw.tenant("a")
    headers = {"Authorization": f"Bearer {key}"}
    async with gw.http.get(gw.url + "/admin/audit", headers=headers) as r:
        assert r.status == 403
    async with gw.http.get(gw.url + "/admin/audit") as r:
        assert r.status == 401


def test_the_command_line_names_its_user_and_reads_the_log(tmp_path, capsys, monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVGATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOGNAME", "ops-alice")  # the first getpass.getuser() reads
    db = ["--database-url", f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"]
    assert kvgate(["tenants", "create", "globex", "--rpm", "60", *db]) == 0
    assert kvgate(["tenants", "update", "globex", "--rpm", "120", *db]) == 0
    assert kvgate(["keys", "create", "globex", "--json", *db]) == 0
    capsys.readouterr()
    assert kvgate(["audit", "--tenant", "globex", "--json", *db]) == 0
    rows = json.loads(capsys.readouterr().out)["data"]
    assert [r["action"] for r in rows] == ["key.create", "tenant.update", "tenant.create"]
    assert {r["actor"] for r in rows} == {"cli:ops-alice"}
    assert kvgate(["audit", "--action", "tenant.update", *db]) == 0
    table = capsys.readouterr().out
    assert "cli:ops-alice" in table and "rpm 60 -> 120" in table
    assert kvgate(["audit", "--limit", "1", *db]) == 0
    assert "more: kvgate audit --cursor" in capsys.readouterr().out
    assert kvgate(["audit", "--limit", "0", *db]) == 1
    assert "--limit" in capsys.readouterr().err


async def test_migration_0011_keeps_the_rows_before_it(tmp_path):
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'old.db'}")
    try:
        await migrate(db, "0010")
        async with db.engine.begin() as conn:
            insert = "INSERT INTO audit_log (ts, actor, action, target, detail) VALUES "
            await conn.execute(
                text(
                    insert + "(1, 'key_a', 'tenant.update', 't_1', :d1), "
                    "(2, 'key_a', 'prefix.unpin', 'pfx_1', :d2)"
                ),
                {"d1": json.dumps({"rpm": 5}), "d2": json.dumps({"tenant_id": "t_1"})},
            )
        await migrate(db)
        async with db.engine.connect() as conn:
            rows = (
                await conn.execute(text("SELECT action, tenant_id, before, after FROM audit_log"))
            ).all()
            diff = await conn.run_sync(_schema_diff)
        assert [
            (a, t, json.loads(b) if b else None, json.loads(f) if f else None)
            for a, t, b, f in rows
        ] == [
            ("tenant.update", "t_1", None, {"rpm": 5}),
            ("prefix.unpin", "t_1", {"tenant_id": "t_1"}, None),
        ]
        assert diff == []
    finally:
        await db.close()


def _schema_diff(sync_conn) -> list:
    """What Alembic finds between the migrated audit_log and gateway/db/tables.py."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from gateway.db import Base

    context = MigrationContext.configure(sync_conn)
    return [d for d in compare_metadata(context, Base.metadata) if "audit_log" in str(d)]


def _config(output_usd: float) -> str:
    return f"""
[[backends]]
name = "fake"
type = "fake"
model = "fake-model"

[prices."fake-model"]
input = 1.0
output = {output_usd}
"""


async def test_a_reload_is_one_row_by_whoever_asked(tmp_path):
    config = tmp_path / "kvgate.toml"
    config.write_text(_config(2.0))
    overrides = {
        "database_url": f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}",
        "admin_key": ADMIN_KEY,
    }
    source = ConfigSource(str(config), overrides)
    settings = source.load()
    server = GatewayTestServer(create_app(settings, source), settings)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            gw = Gateway(server, http)
            log, actor = Log(gw), await admin_key_id(gw)
            await log.new()
            config.write_text(_config(4.0))
            status, done = await gw.admin("POST", "/admin/reload")
            assert status == 200 and done["changed"] == ["prices"], done
            row = await one_change(log, "config.reload", "config")
            assert row["actor"] == actor
            assert row["before"]["prices"]["fake-model"]["output"] == 2.0
            assert row["after"]["prices"]["fake-model"]["output"] == 4.0
            assert row["before"]["backends"] == row["after"]["backends"] == ["fake"]
            config.write_text("[[backends]]\nname = ")  # refused whole: no change, no row
            assert (await gw.admin("POST", "/admin/reload"))[0] == 400
            assert await log.new() == []
            config.write_text(_config(3.0))
            await reload_on_signal(gw.state)  # SIGHUP's
            row = await one_change(log, "config.reload", "config")
            assert (
                row["actor"] == SIGNAL_ACTOR
                and row["after"]["prices"]["fake-model"]["output"] == 3.0
            )
    finally:
        await server.close()
