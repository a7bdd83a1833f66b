"""Gateways sharing one PostgreSQL keep their prefix-catalog rows apart.

Two gateways that both run a replica of the same name, with the same tenants (so the
same cache salts and block hashes), must not write the same rows, and one's restart
must drop only its own stale rows: before rows carried the gateway's instance, a
restarting gateway loaded every row as its own and deleted the other's.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import aiohttp
import pytest
from sqlalchemy import select

from gateway.app import create_app
from gateway.backends import BackendSpec, KVEvent
from gateway.config import Settings
from gateway.config_load import load_settings
from gateway.db import PrefixBlock
from gateway.http.server import GatewayTestServer
from gateway.lifecycle import start_gateway, stop_gateway
from gateway.state import GW, GatewayState
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.conftest import ADMIN_KEY, PG_URL
from tests.gateway.conftest import fake_backends
from tests.gateway.test_prefixes import cached, eventually, gpu_backends


def settings(pg_schema: str, instance: str, backends: list[BackendSpec]) -> Settings:
    db = {"database_url": PG_URL, "database_schema": pg_schema}
    return Settings(**db, admin_key=ADMIN_KEY, backend="", backends=backends, instance=instance)


def stored(h: str, parent: str | None, at: float) -> KVEvent:
    return KVEvent("stored", "fake", h, parent, None, 16, at)


async def rows(state: GatewayState) -> dict[tuple[str, str], int]:
    """(replica key, block hash) -> hits, for every gateway's rows."""
    async with state.db.session() as s:
        found = (await s.scalars(select(PrefixBlock))).all()
    return {(r.replica, r.block_hash): r.hits for r in found}


@pytest.mark.pg
async def test_a_restart_drops_only_its_own_stale_rows(pg_schema) -> None:
    a = await start_gateway(settings(pg_schema, "gw-a:8000", fake_backends()))
    b = await start_gateway(settings(pg_schema, "gw-b:8000", fake_backends()))
    try:
        for state in (a, b):  # the test drains and flushes by hand, never racing the task
            await state.catalog.stop()
        # both run a replica "fake" that caches the same block h1 (the events an engine
        # reports; the fake backend has no cache of its own)
        a.catalog.apply([stored("h1", None, 1.0), stored("h2", "h1", 1.0)])
        a.catalog.record_hits("fake", ["h1", "h2"], 32)
        b.catalog.apply([stored("h1", None, 2.0), stored("h3", "h1", 2.0)])
        await a.catalog.flush()
        await b.catalog.flush()
        assert await rows(a) == {
            ("gw-a:8000/fake", "h1"): 1,
            ("gw-a:8000/fake", "h2"): 1,
            ("gw-b:8000/fake", "h1"): 0,  # its own row: A's hits are not overwritten
            ("gw-b:8000/fake", "h3"): 0,
        }
        await stop_gateway(b)
        # B restarts: it loads its own rows only (its task flushes a second after start)
        b = await start_gateway(settings(pg_schema, "gw-b:8000", fake_backends()))
        assert set(b.catalog.stale) == {"fake"} and set(b.catalog.stale["fake"]) == {"h1", "h3"}
        b.catalog.apply([stored("h1", None, 3.0)])  # stored again after the restart
        await b.catalog.stop()  # the first flush drops B's other stale rows
        assert await rows(a) == {
            ("gw-a:8000/fake", "h1"): 1,
            ("gw-a:8000/fake", "h2"): 1,
            ("gw-b:8000/fake", "h1"): 0,
        }
        assert a.catalog.match("fake", ["h1", "h2"]) == 2 and b.catalog.match("fake", ["h1"]) == 1
    finally:
        await stop_gateway(b)
        await stop_gateway(a)


def test_the_instance_defaults_to_host_and_port_and_takes_no_slash() -> None:
    assert Settings(port=8123).instance == f"{socket.gethostname()}:8123"
    assert load_settings(environ={"KVGATE_INSTANCE": "gw-7"}).instance == "gw-7"
    with pytest.raises(ValueError, match="instance"):
        Settings(instance="a/b")


# -- the same on real engines (a tiny gpu model), called over HTTP ----------------------

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("instances-model")))


@dataclass
class Served:
    """A gateway on a real socket; `url` is all that `cached` reads of it."""

    server: GatewayTestServer
    url: str

    @property
    def state(self) -> GatewayState:
        return self.server.app[GW]


async def serve(pg_schema: str, instance: str, model_dir: str) -> Served:
    s = settings(pg_schema, instance, gpu_backends(model_dir))
    server = GatewayTestServer(create_app(s), s)
    await server.start_server()
    return Served(server, str(server.make_url("")).rstrip("/"))


async def tenant_key(http: aiohttp.ClientSession, url: str) -> str:
    async with http.post(url + "/admin/tenants", json={"name": "t"}, headers=ADMIN) as r:
        tenant = await r.json()
    async with http.post(url + f"/admin/tenants/{tenant['id']}/keys", json={}, headers=ADMIN) as r:
        return (await r.json())["key"]


def owners(found: dict) -> set[str]:
    return {replica for replica, _ in found}


@pytest.mark.pg
@pytest.mark.slow
async def test_two_gateways_with_one_replica_name_on_real_engines(pg_schema, tiny_model) -> None:
    a = await serve(pg_schema, "gw-a:1", tiny_model)
    b = await serve(pg_schema, "gw-b:1", tiny_model)
    http = aiohttp.ClientSession()
    try:
        key = await tenant_key(http, a.url)
        for gw in (a, b):  # one tenant, one salt: the same blocks on both gateways' "tiny"
            assert await cached(gw, key, "What is paging?") == 0
            assert await cached(gw, key, "What is paging?") > 0
        written = await eventually(lambda: rows(a.state), lambda f: len(owners(f)) == 2)
        assert owners(written) == {"gw-a:1/tiny", "gw-b:1/tiny"}
        a_rows = {k: hits for k, hits in written.items() if k[0] == "gw-a:1/tiny"}
        assert sum(a_rows.values()) > 0
        await b.server.close()  # B restarts with an empty engine: its rows are all stale
        b = await serve(pg_schema, "gw-b:1", tiny_model)
        left = await eventually(lambda: rows(a.state), lambda f: "gw-b:1/tiny" not in owners(f))
        assert owners(left) == {"gw-a:1/tiny"}
        assert {k: hits for k, hits in left.items() if k[0] == "gw-a:1/tiny"} == a_rows
        async with http.get(a.url + "/admin/prefixes", headers=ADMIN) as r:
            report = await r.json()
        assert {p["replica"] for p in report["prefixes"]} == {"tiny"}  # the backend's name
    finally:
        await http.close()
        await b.server.close()
        await a.server.close()
