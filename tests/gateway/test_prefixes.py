"""Prefix caching across the gateway: the catalog, pinned and published prefixes, isolation."""

from __future__ import annotations

import asyncio

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from openai import AsyncOpenAI
from sqlalchemy import select

from gateway.backends import BackendSpec, KVEvent
from gateway.backends.default_model import DEFAULT_MODEL_ID
from gateway.cli import main as cli_main
from gateway.db import Base, Database, PinnedPrefix, PrefixBlock, migrate
from gateway.routing.catalog import UNKNOWN_TENANT, PrefixCatalog
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.conftest import ADMIN_KEY, PG_URL


def stored(replica: str, h: str, parent: str | None, salt: str | None, at: float = 1.0):
    return KVEvent("stored", replica, h, parent, salt, 16, at)


def removed(replica: str, h: str):
    return KVEvent("removed", replica, h, None, None, 16, 2.0)


def chain(replica: str, salt: str | None, *hashes: str) -> list[KVEvent]:
    """Stored events for blocks that each follow the one before, as one prompt's blocks do."""
    return [stored(replica, h, hashes[i - 1] if i else None, salt) for i, h in enumerate(hashes)]


def test_catalog_match_counts_leading_blocks_per_replica() -> None:
    cat = PrefixCatalog()
    cat.note_salt("salt-a", "tenant-a")
    cat.apply(chain("r0", "salt-a", "h1", "h2", "h3") + chain("r1", "salt-a", "h1"))
    assert cat.match("r0", ["h1", "h2", "h3", "h4"]) == 3
    assert cat.match("r1", ["h1", "h2", "h3"]) == 1
    assert cat.match("r2", ["h1"]) == 0
    assert cat.match("r0", ["hx", "h2"]) == 0  # a prefix stops at the first gap
    assert cat.replicas["r0"]["h2"].tenant_id == "tenant-a"
    cat.apply([removed("r0", "h2")])
    assert cat.match("r0", ["h1", "h2", "h3"]) == 1
    assert ("r0", "h2") in cat.removed and ("r0", "h2") not in cat.dirty


def lower(kind: str, replica: str, h: str) -> KVEvent:
    """A block entering ("stored") or leaving ("removed") the replica's lower tiers, as
    the gpu engine says it: no parent, no salt."""
    return KVEvent(kind, replica, h, None, None, 16, 3.0, "lower")


async def test_catalog_keeps_what_the_device_and_the_lower_tiers_hold(tmp_path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'cat.db'}")
    await migrate(db)
    try:
        cat = PrefixCatalog(db)
        cat.note_salt("salt-a", "tenant-a")
        cat.apply(chain("r0", "salt-a", "h1", "h2", "h3"))
        # h2 and h3 are written down, then evicted from the device
        cat.apply([lower("stored", "r0", "h2"), lower("stored", "r0", "h3")])
        cat.apply([removed("r0", "h2"), removed("r0", "h3")])
        assert cat.match("r0", ["h1", "h2", "h3", "h4"]) == 1  # the device's
        assert cat.match_tiers("r0", ["h1", "h2", "h3", "h4"]) == (3, 1)
        assert cat.match_tiers("r0", ["h2", "h3"]) == (2, 0)  # only down there
        assert cat.match_tiers("r1", ["h1"]) == (0, 0)
        assert not cat.removed  # still held: the rows stay
        # a hit loaded from the tier credits the block; stored again on the device, the
        # block keeps its entry (one row, its hits)
        cat.record_hits("r0", ["h1", "h2"], 32)
        cat.apply([stored("r0", "h2", "h1", "salt-a", at=4.0)])
        assert cat.replicas["r0"]["h2"] is cat.lower["r0"]["h2"]
        assert cat.replicas["r0"]["h2"].hits == 1
        h3 = cat.lower["r0"]["h3"]
        assert (h3.tenant_id, h3.parent_hash) == ("tenant-a", "h2")  # as the device said
        # gone from the device and then from the tier: gone
        cat.apply([removed("r0", "h2"), lower("removed", "r0", "h2")])
        cat.apply([lower("removed", "r0", "h3")])
        assert cat.match_tiers("r0", ["h1", "h2"]) == (1, 1)
        await cat.flush()
        assert await rows(db) == {("r0", "h1"): (1, 16, "tenant-a")}
        # a block the tier holds and the device never did (a disk from the last run) is
        # a row of its own, of no known tenant (never a published one) until the device
        # stores it and says whose it is
        cat.apply([lower("stored", "r1", "h1")])
        await cat.flush()
        assert set(await rows(db)) == {("r0", "h1"), ("r1", "h1")}
        assert "r1" not in cat.replicas and cat.lower["r1"]["h1"].tenant_id == UNKNOWN_TENANT
        cat.apply([stored("r1", "h1", None, "salt-a", at=5.0)])
        assert cat.replicas["r1"]["h1"].tenant_id == "tenant-a"
        with pytest.raises(ValueError, match="unknown KV event medium"):
            cat.apply([KVEvent("stored", "r0", "h9", None, None, 16, 0.0, "tape")])
    finally:
        await db.close()


def test_catalog_tenants_of_salts() -> None:
    cat = PrefixCatalog()
    cat.note_salt("salt-a", "tenant-a")
    cat.apply([stored("r0", "p1", None, None), stored("r0", "x1", None, "never-seen")])
    assert cat.replicas["r0"]["p1"].tenant_id is None  # published: shared by every tenant
    assert cat.replicas["r0"]["x1"].tenant_id == UNKNOWN_TENANT  # never shown as published


def test_catalog_record_hits_credits_the_cached_blocks() -> None:
    cat = PrefixCatalog()
    cat.apply(chain("r0", None, "h1", "h2", "h3"))
    cat.record_hits("r0", ["h1", "h2", "h3"], 20)
    entries = cat.replicas["r0"]
    assert [entries[h].hits for h in ("h1", "h2", "h3")] == [1, 1, 0]
    assert [entries[h].tokens_saved for h in ("h1", "h2", "h3")] == [16, 4, 0]


def test_hottest_names_where_a_shared_prompt_ends() -> None:
    cat = PrefixCatalog()
    cat.note_salt("salt-a", "tenant-a")
    system = [stored("r0", "s1", None, "salt-a"), stored("r0", "s2", "s1", "salt-a")]
    questions = [stored("r0", "q1", "s2", "salt-a"), stored("r0", "q2", "s2", "salt-a")]
    cat.apply(system + questions + [stored("r0", "p1", None, None)])
    for _ in range(3):
        cat.record_hits("r0", ["s1", "s2", "q9"], 32)  # the system prompt, a new question
    cat.record_hits("r0", ["s1", "s2", "q1"], 40)  # a question asked again
    rows = {r["block_hash"]: r for r in cat.hottest(lambda tenant: True, 10)}
    assert set(rows) == {"s2", "q1", "q2", "p1"}  # s1's hits all went on to s2
    assert (rows["s2"]["blocks"], rows["s2"]["tokens"], rows["s2"]["hits"]) == (2, 32, 4)
    assert rows["s2"]["tokens_saved"] == 128 and rows["q1"]["tokens_saved"] == 136
    assert [r["block_hash"] for r in cat.hottest(lambda tenant: True, 2)] == ["q1", "s2"]
    published = cat.hottest(lambda tenant: tenant is None, 10)
    assert [r["block_hash"] for r in published] == ["p1"]
    assert cat.held_by_tenant(lambda tenant: True) == {"tenant-a": (4, 64), None: (1, 16)}


async def test_catalog_survives_a_restart_and_keeps_the_blocks_stored_again(tmp_path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'cat.db'}")
    await migrate(db)
    try:
        cat = PrefixCatalog(db)
        cat.note_salt("salt-a", "tenant-a")
        stored_again = chain("r0", "salt-a", "h1", "h2") + chain("r1", "salt-a", "h1")
        cat.apply(stored_again + [removed("r1", "h1")])
        cat.record_hits("r0", ["h1", "h2"], 20)
        await cat.flush()
        assert await rows(db) == {
            ("r0", "h1"): (1, 16, "tenant-a"),
            ("r0", "h2"): (1, 4, "tenant-a"),
        }

        again = PrefixCatalog(db)  # the gateway restarted; its engines are empty
        await again.load()
        assert again.match("r0", ["h1", "h2"]) == 0
        again.apply([stored("r0", "h1", None, "salt-a", at=5.0)])  # a pin's prefill
        await again.flush()  # drops the rows no replica stored again
        assert again.match("r0", ["h1", "h2"]) == 1
        assert await rows(db) == {("r0", "h1"): (1, 16, "tenant-a")}  # its history kept
    finally:
        await db.close()


async def rows(db: Database) -> dict:
    async with db.session() as s:
        found = (await s.scalars(select(PrefixBlock))).all()
    return {(r.replica, r.block_hash): (r.hits, r.tokens_saved, r.tenant_id) for r in found}


def test_catalog_rejects_an_unknown_event_kind() -> None:
    with pytest.raises(ValueError, match="unknown KV event kind"):
        PrefixCatalog().apply([KVEvent("evicted", "r0", "h", None, None, 16, 0.0)])


async def test_catalog_round_trip_on_postgresql(pg_schema) -> None:
    db = Database(PG_URL, pg_schema)
    try:
        assert await schema_drift(db) == []  # migrates, and checks the migration on PostgreSQL
        cat = PrefixCatalog(db)
        cat.apply([stored("r0", "h1", None, None), stored("r0", "h2", "h1", None)])
        cat.record_hits("r0", ["h1", "h2"], 32)
        await cat.flush()
        cat.record_hits("r0", ["h1"], 16)  # an upsert of an existing row
        cat.apply([removed("r0", "h2")])
        await cat.flush()
        assert await rows(db) == {("r0", "h1"): (2, 32, None)}
        again = PrefixCatalog(db)
        await again.load()
        assert again.stale["r0"]["h1"].hits == 2
    finally:
        await db.close()


async def schema_drift(db: Database) -> list:
    """What differs between the migrated database and the tables in gateway/db/tables.py."""
    await migrate(db)

    def compare(conn) -> list:
        return compare_metadata(MigrationContext.configure(conn), Base.metadata)

    async with db.engine.connect() as conn:
        return await conn.run_sync(compare)


async def test_migration_0003_matches_the_tables(tmp_path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
    try:
        assert await schema_drift(db) == []
    finally:
        await db.close()


# -- the gateway on a tiny gpu model, called over HTTP -------------------------------------

SYSTEM = " ".join(["Paged attention stores keys and values in fixed-size blocks."] * 2)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("prefix-model")))


def gpu_backends(model_dir: str) -> list[BackendSpec]:
    return [BackendSpec("tiny", "gpu", model_dir, "tiny", {"seed": 1})]


def client(gw, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def cached(gw, key: str, question: str, system: str = SYSTEM, model: str = "tiny") -> int:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    chat = await client(gw, key).chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0
    )
    return chat.usage.prompt_tokens_details.cached_tokens


async def call(gw, method: str, path: str, key: str, body=None) -> tuple[int, dict]:
    async with gw.http.request(
        method, gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        return r.status, await r.json()


async def eventually(get, want):
    """get() once it equals `want` (or `want(value)` holds), polling for up to 10 s."""
    for _ in range(200):
        value = get()
        if asyncio.iscoroutine(value):
            value = await value
        if want(value) if callable(want) else value == want:
            break
        await asyncio.sleep(0.05)
    return value


async def stop(gw) -> None:
    await gw.http.close()
    await gw.server.close()


@pytest.mark.slow
async def test_tenants_never_hit_each_others_cache(make_gateway, tiny_llama) -> None:
    gw = await make_gateway(gpu_backends(tiny_llama))
    _, key_a = await gw.tenant("a")
    _, key_b = await gw.tenant("b")
    assert await cached(gw, key_a, "What is paging?") == 0
    assert await cached(gw, key_a, "What is paging?") > 0
    assert await cached(gw, key_b, "What is paging?") == 0  # A's exact prompt, B's salt
    # the catalog names the tenant that owns each block, and B sees none of A's
    tenant_ids = {t["name"]: t["id"] for t in (await gw.admin("GET", "/admin/tenants"))[1]["data"]}
    owners = {tenant_ids["a"], tenant_ids["b"]}

    def cataloged() -> set:
        return {e.tenant_id for held in gw.state.catalog.replicas.values() for e in held.values()}

    async def written() -> set:
        return {tenant for _, _, tenant in (await rows(gw.state.db)).values()}

    # KV events reach the catalog in the background, and it writes about once a second
    assert await eventually(cataloged, owners) == owners
    assert await eventually(written, owners) == owners
    status, report = await call(gw, "GET", "/admin/prefixes", key_b)
    assert status == 200
    assert report["prefixes"] and {p["tenant_id"] for p in report["prefixes"]} == {tenant_ids["b"]}
    assert [t["tenant_id"] for t in report["tenants"]] == [tenant_ids["b"]]
    status, report = await call(gw, "GET", f"/admin/prefixes?tenant_id={tenant_ids['a']}", key_b)
    assert status == 404 and report["error"]["message"]
    # metrics: prompt tokens looked up and hit, per tenant
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with gw.http.get(gw.url + "/metrics", headers=admin) as r:
        text = await r.text()
    assert 'kvgate:prefix_cache_queries_total{model="tiny",tenant="a"}' in text
    hits_line = 'kvgate:prefix_cache_hits_total{model="tiny",tenant="a"}'
    hits = [line for line in text.splitlines() if line.startswith(hits_line)]
    assert hits and float(hits[0].split()[-1]) > 0


@pytest.mark.slow
async def test_a_published_prefix_is_reused_by_every_tenant(make_gateway, tiny_llama) -> None:
    gw = await make_gateway(gpu_backends(tiny_llama))
    _, key_a = await gw.tenant("a")
    _, key_b = await gw.tenant("b")
    published = {"tenant": None, "name": "house-style", "text": SYSTEM, "model": "tiny"}
    status, pin = await gw.admin("POST", "/admin/prefixes/pins", published)
    assert status == 201, pin
    assert pin["shared"] is True and pin["tenant_id"] is None and pin["replicas_warmed"] == 1
    # both tenants' first requests reuse the blocks the publication prefilled
    assert await cached(gw, key_a, "First question?") > 0
    assert await cached(gw, key_b, "Another question?") > 0
    # a tenant's own system prompt is still its own
    other = "Continuous batching lets requests join and leave at every step. " * 2
    assert await cached(gw, key_a, "Q?", other) == 0
    assert await cached(gw, key_b, "Q?", other) == 0
    for key in (key_a, key_b):  # each tenant sees the published pin, with its hits
        status, listed = await call(gw, "GET", "/v1/prefixes", key)
        assert [p["name"] for p in listed["data"]] == ["house-style"]
        status, report = await call(gw, "GET", "/admin/prefixes", key)
        (row,) = report["pins"]
        assert row["replicas"] == ["tiny"] and row["hits"] >= 2 and row["tokens_saved"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["gpu", "local"])
async def test_pins_are_warm_after_a_restart_and_the_catalog_survives(
    make_gateway, tiny_llama, engine
) -> None:
    if engine == "gpu":
        backends, model = gpu_backends(tiny_llama), "tiny"
    else:  # llama.cpp on the default Gemma 3 270M
        options = {"n_ctx": 512, "n_parallel": 2, "n_batch": 128, "n_threads": 1}
        backends, model = [BackendSpec("local", "local", "", "", options)], DEFAULT_MODEL_ID
    gw = await make_gateway(backends)
    tenant_a, key_a = await gw.tenant("a")
    _, key_b = await gw.tenant("b")
    status, pin = await call(gw, "POST", "/v1/prefixes", key_a, {"name": "support", "text": SYSTEM})
    assert status == 201, pin
    assert pin["tenant_id"] == tenant_a["id"] and pin["model"] == model and pin["tokens"] > 16
    assert await cached(gw, key_a, "Before the restart?", model=model) > 0
    await stop(gw)  # the catalog's last flush writes its rows

    gw = await make_gateway(backends)  # same database, fresh engine

    async def pins() -> list:
        return (await gw.admin("GET", "/admin/prefixes"))[1]["pins"]

    (row,) = await eventually(pins, lambda found: found[0]["replicas"])  # the prefill's events
    assert row["name"] == "support" and row["replicas"] == [backends[0].name]
    assert row["hits"] == 1  # counted before the restart: the catalog's rows came back
    assert await cached(gw, key_a, "The first request after the restart?", model=model) > 0
    assert await cached(gw, key_b, "Someone else's?", model=model) == 0
    (row,) = await eventually(pins, lambda found: found[0]["hits"] == 2)
    assert row["hits"] == 2 and row["tokens_saved"] >= 2 * 16
    status, listed = await call(gw, "GET", "/v1/prefixes", key_b)
    assert listed["data"] == []  # B does not see A's pin
    status, gone = await call(gw, "DELETE", "/v1/prefixes/support", key_b)
    assert status == 404
    status, gone = await call(gw, "DELETE", "/v1/prefixes/support", key_a)
    assert status == 200 and gone["deleted"] is True
    async with gw.state.db.session() as s:
        assert (await s.scalars(select(PinnedPrefix))).all() == []


@pytest.mark.slow
async def test_bad_pins_get_openai_errors_and_change_nothing(make_gateway, tiny_llama) -> None:
    gw = await make_gateway(gpu_backends(tiny_llama))
    tenant_a, key_a = await gw.tenant("a")
    status, _ = await call(gw, "POST", "/v1/prefixes", key_a, {"name": "p", "text": SYSTEM})
    assert status == 201
    too_long = "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026. " * 40
    pin = {"name": "q", "text": "x", "model": "tiny"}
    shared_by_a_tenant = {"tenant": tenant_a["id"], **pin, "shared": True}
    cases = [
        (key_a, "/v1/prefixes", {"name": "p", "text": "other"}, 409),  # duplicate name
        (key_a, "/v1/prefixes", {"name": "q", "text": ""}, 400),
        (key_a, "/v1/prefixes", {"name": "q", "text": "   "}, 400),
        (key_a, "/v1/prefixes", {"name": "q", "text": too_long}, 400),
        (key_a, "/v1/prefixes", {"name": "no spaces", "text": "x"}, 400),
        (key_a, "/v1/prefixes", {"name": "q", "text": "x", "model": "nope"}, 404),
        (ADMIN_KEY, "/admin/prefixes/pins", {"tenant": "t_nope", **pin}, 404),
        (ADMIN_KEY, "/admin/prefixes/pins", shared_by_a_tenant, 400),
        (key_a, "/admin/prefixes/pins", {"tenant": None, "name": "q", "text": "x"}, 403),
        (ADMIN_KEY, "/v1/prefixes", {"name": "q", "text": "x"}, 403),
    ]
    for key, path, body, want in cases:
        status, error = await call(gw, "POST", path, key, body)
        assert status == want, (body, error)
        assert error["error"]["message"] and error["error"]["type"], error
    status, error = await call(gw, "POST", "/v1/prefixes", key_a, {"name": "q", "text": too_long})
    assert error["error"]["code"] == "context_length_exceeded"
    for query in ("limit=0", "limit=x"):
        status, error = await call(gw, "GET", f"/admin/prefixes?{query}", key_a)
        assert status == 400 and error["error"]["param"] == "limit"
    status, listed = await call(gw, "GET", "/v1/prefixes", key_a)
    assert [p["name"] for p in listed["data"]] == ["p"]
    async with gw.state.db.session() as s:
        assert len((await s.scalars(select(PinnedPrefix))).all()) == 1
    # deleting the tenant takes its pins with it, from the database and the report
    status, _ = await gw.admin("DELETE", f"/admin/tenants/{tenant_a['id']}")
    assert status == 200
    status, report = await gw.admin("GET", "/admin/prefixes")
    assert report["pins"] == []
    async with gw.state.db.session() as s:
        assert (await s.scalars(select(PinnedPrefix))).all() == []


@pytest.mark.slow
async def test_kvgate_prefixes_prints_the_report(make_gateway, tiny_llama, capsys) -> None:
    gw = await make_gateway(gpu_backends(tiny_llama))
    _, key_a = await gw.tenant("a")
    status, _ = await call(gw, "POST", "/v1/prefixes", key_a, {"name": "support", "text": SYSTEM})
    assert await cached(gw, key_a, "Hello?") > 0
    argv = ["prefixes", "--url", gw.url, "--key", ADMIN_KEY]
    assert await asyncio.to_thread(cli_main, argv) == 0
    out = capsys.readouterr().out
    assert "hottest prefixes" in out and "support" in out and "per tenant" in out
    assert await asyncio.to_thread(cli_main, ["prefixes", "--url", gw.url, "--key", "bad"]) == 1
