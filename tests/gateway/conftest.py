"""An in-process gateway on a real socket, with helpers to make tenants and keys."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from gateway.backends import BackendSpec
from gateway.config import Settings
from gateway.db import Database, migrate
from gateway.http.server import GatewayTestServer
from gateway.state import GW, GatewayState
from tests.conftest import ADMIN_KEY, PG_URL


@dataclass
class Gateway:
    server: TestServer
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def state(self) -> GatewayState:
        return self.server.app[GW]

    def backend(self, name: str):
        return next(b for b in self.state.backends if b.name == name)

    async def admin(self, method: str, path: str, json: Any = None) -> tuple[int, Any]:
        async with self.http.request(
            method, self.url + path, json=json, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ) as r:
            return r.status, await r.json()

    async def tenant(self, name: str = "acme", **quota: Any) -> tuple[dict, str]:
        status, tenant = await self.admin("POST", "/admin/tenants", {"name": name, **quota})
        assert status == 201, tenant
        status, key = await self.admin("POST", f"/admin/tenants/{tenant['id']}/keys", {})
        assert status == 201, key
        return tenant, key["key"]

    async def post(self, path: str, key: str | None, body: Any, **kw: Any):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return await self.http.post(self.url + path, json=body, headers=headers, **kw)

    async def chat(self, key: str, content: str = "hello there", **fields: Any):
        body = {"model": "fake-model", "messages": [{"role": "user", "content": content}]}
        return await self.post("/v1/chat/completions", key, body | fields)


def fake_backends(**options: Any) -> list[BackendSpec]:
    return [BackendSpec("fake", "fake", "", "fake-model", options)]


@pytest.fixture
async def make_gateway(tmp_path) -> AsyncIterator:
    started: list[Gateway] = []

    async def make(backends: list[BackendSpec] | None = None, **settings: Any) -> Gateway:
        s = Settings(
            # SQLite in the test's directory unless a test names another database
            database_url=settings.pop("database_url", f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}"),
            admin_key=ADMIN_KEY,
            backend="",
            backends=backends or fake_backends(),
            **settings,
        )
        server = GatewayTestServer(create_app(s), s)
        await server.start_server()
        gw = Gateway(server, aiohttp.ClientSession())
        started.append(gw)
        return gw

    yield make
    for gw in started:
        await gw.http.close()
        await gw.server.close()


@pytest.fixture
async def gw(make_gateway) -> Gateway:
    return await make_gateway()


# a migrated database of each kind, for the modules that test a store on both
@pytest.fixture(params=["sqlite", "postgres"])
async def db(request, tmp_path) -> AsyncIterator[Database]:
    if request.param == "postgres":
        db = Database(PG_URL, request.getfixturevalue("pg_schema"))
    else:
        db = Database(f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}")
    await migrate(db)
    yield db
    await db.close()
