"""LoRA adapters in the gateway, with the fake backend (it accepts an adapter whose path
exists and records the requests run under each): the registry and its admin API, a
tenant's adapter invisible to other tenants, allowed models, prices and usage rows naming
the adapter, refusals that store nothing, deletion with a request in flight, the config's
lora_modules, the CLI, persistence (SQLite and PostgreSQL), and the router's preference."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from sqlalchemy import func, select

from gateway.backends import BackendSpec, BackendStats
from gateway.backends.spec import LoraModule
from gateway.cli import main as cli_main
from gateway.cli.main import build_parser
from gateway.config_load import load_settings
from gateway.db import AuditLog, LoraAdapter
from gateway.routing.router import Router
from gateway.worker.cli import LORA_DEFAULTS
from tests.conftest import ADMIN_KEY, PG_URL
from tests.gateway.conftest import fake_backends
from tests.gateway.test_url_only_upstreams import UPSTREAM_ID, BareUpstream


@pytest.fixture
def adapter_dir(tmp_path):
    path = tmp_path / "sql-lora"
    path.mkdir()
    return str(path)


async def register(gw, name: str, path: str, tenant: str | None = None, base: str = "fake-model"):
    body = {"name": name, "path": path, "base_model": base, "tenant": tenant}
    return await gw.admin("POST", "/admin/adapters", body)


async def models_of(gw, key: str) -> dict[str, dict]:
    async with gw.http.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200
        return {m["id"]: m for m in (await r.json())["data"]}


async def test_a_public_adapter_is_served_over_its_base_model(make_gateway, adapter_dir):
    prices = {"sql-lora": {"input": 2.0, "output": 4.0}, "fake-model": {"input": 1, "output": 1}}
    gw = await make_gateway(prices=prices)
    status, adapter = await register(gw, "sql-lora", adapter_dir)
    assert status == 201, adapter
    assert adapter["base_model"] == "fake-model" and adapter["tenant_id"] is None
    tenant, key = await gw.tenant()
    models = await models_of(gw, key)
    assert models["sql-lora"]["parent"] == "fake-model"
    assert "parent" not in models["fake-model"]
    r = await gw.chat(key, model="sql-lora", max_tokens=5)
    body = await r.json()
    assert r.status == 200, body
    assert body["model"] == "sql-lora"  # the client's name, as vLLM answers
    base = await (await gw.chat(key, max_tokens=5)).json()
    # the fake words its output by the adapter too: the request ran under it
    assert body["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    assert gw.backend("fake").adapter_requests == {"sql-lora": 1}
    assert gw.backend("fake").stats().extra["adapters_loaded"] == ["sql-lora"]
    _, usage = await gw.admin("GET", f"/admin/usage?tenant_id={tenant['id']}")
    by_model = {m["model"]: m for m in usage["data"]}
    assert set(by_model) == {"sql-lora", "fake-model"}
    # the adapter's own price: 2 $/M in and 4 $/M out, against the base model's 1 and 1
    used = by_model["sql-lora"]
    expected = (2 * used["prompt_tokens"] + 4 * used["completion_tokens"]) / 1e6
    assert used["spend"] == pytest.approx(expected, abs=1e-8)  # rounded up to 1e-9 $


async def test_an_adapter_without_a_price_costs_what_its_base_model_does(make_gateway, adapter_dir):
    gw = await make_gateway(prices={"fake-model": {"input": 3.0, "output": 5.0}})
    assert (await register(gw, "sql-lora", adapter_dir))[0] == 201
    assert gw.state.price_of("sql-lora") == gw.state.settings.price_of("fake-model")
    assert gw.state.price_of("other") == gw.state.settings.price_of("other")


async def test_a_tenants_adapter_does_not_exist_for_other_tenants(make_gateway, adapter_dir):
    gw = await make_gateway()
    a, key_a = await gw.tenant("a")
    _, key_b = await gw.tenant("b")
    status, adapter = await register(gw, "a-lora", adapter_dir, tenant="a")  # by name
    assert status == 201, adapter
    assert adapter["tenant_id"] == a["id"]
    assert "a-lora" in await models_of(gw, key_a)
    assert "a-lora" not in await models_of(gw, key_b)
    r = await gw.chat(key_b, model="a-lora")
    unknown = await gw.chat(key_b, model="no-such-model")
    assert r.status == unknown.status == 404
    error, unknown_error = (await r.json())["error"], (await unknown.json())["error"]
    assert error["code"] == unknown_error["code"] == "model_not_found"
    assert "a-lora" not in error["message"].split("Available:")[1]  # not even offered
    for path in ("/tokenize", "/detokenize"):
        body = {"model": "a-lora", "prompt": "hi"} if path == "/tokenize" else {}
        body = body or {"model": "a-lora", "tokens": [1]}
        assert (await gw.post(path, key_b, body)).status == 404
    r = await gw.chat(key_a, model="a-lora")
    assert r.status == 200, await r.text()
    tokens = await gw.post("/tokenize", key_a, {"model": "a-lora", "prompt": "hi there"})
    assert (await tokens.json())["count"] == 2


async def test_allowed_models_name_the_adapter(make_gateway, adapter_dir):
    gw = await make_gateway()
    assert (await register(gw, "sql-lora", adapter_dir))[0] == 201
    _, base_only = await gw.tenant("base-only", models=["fake-model"])
    _, lora_only = await gw.tenant("lora-only", models=["sql-lora"])
    assert (await gw.chat(base_only, model="sql-lora")).status == 403
    assert "sql-lora" not in await models_of(gw, base_only)
    assert (await gw.chat(lora_only, model="sql-lora")).status == 200
    assert (await gw.chat(lora_only)).status == 403  # the base model itself is not allowed
    assert set(await models_of(gw, lora_only)) == {"sql-lora"}


async def test_bad_adapters_are_refused_and_nothing_is_stored(make_gateway, adapter_dir, tmp_path):
    gw = await make_gateway()
    assert (await register(gw, "taken", adapter_dir))[0] == 201
    cases = {
        "nope": (await register(gw, "nope", str(tmp_path / "missing")), "no such path"),
        "taken": (await register(gw, "taken", adapter_dir), "taken by another adapter"),
        "fake-model": (await register(gw, "fake-model", adapter_dir), "taken by a model"),
        "other": (await register(gw, "other", adapter_dir, base="gpt-9"), "no base model"),
    }
    for name, ((status, body), words) in cases.items():
        assert status == 400, (name, body)
        assert words in body["error"]["message"], (name, body)
    status, body = await register(gw, "t-lora", adapter_dir, tenant="nobody")
    assert status == 404 and "nobody" in body["error"]["message"]
    status, body = await gw.admin("POST", "/admin/adapters", {"name": "a/b", "path": adapter_dir})
    assert status == 400  # the body itself (a name with '/', no base model)
    _, listed = await gw.admin("GET", "/admin/adapters")
    assert [a["name"] for a in listed["data"]] == ["taken"]
    async with gw.state.db.session() as s:
        assert await s.scalar(select(func.count()).select_from(LoraAdapter)) == 1


async def test_a_backend_without_lora_refuses_registration(make_gateway, adapter_dir):
    gw = await make_gateway()

    class NoLora:  # the fake's replica as a backend that serves no adapters
        def __init__(self, inner):
            self.inner = inner
            self.name = inner.name

        def __getattr__(self, attr):
            if attr in ("check_adapter", "remove_adapter"):
                raise AttributeError(attr)
            return getattr(self.inner, attr)

    gw.state.router.serving["fake-model"] = [NoLora(gw.backend("fake"))]
    status, body = await register(gw, "sql-lora", adapter_dir)
    assert status == 400 and "serves no LoRA adapters" in body["error"]["message"]


async def test_deleting_lets_requests_in_flight_finish_then_unloads(make_gateway, adapter_dir):
    gw = await make_gateway(fake_backends(tokens_per_second=50))
    _, key = await gw.tenant()
    assert (await register(gw, "sql-lora", adapter_dir))[0] == 201
    fake = gw.backend("fake")
    r = await gw.chat(key, model="sql-lora", max_tokens=40, stream=True)
    assert r.status == 200
    await r.content.readline()  # the stream is under way
    status, body = await gw.admin("DELETE", "/admin/adapters/sql-lora")
    assert status == 200 and body["deleted"] is True
    assert (await gw.chat(key, model="sql-lora")).status == 404  # gone for new requests
    assert fake.removed_adapters == []  # not while its request runs
    rest = await r.read()
    assert b"[DONE]" in rest and b'"error"' not in rest
    await asyncio.wait_for(gw.state.adapters.stop(), 30)
    assert fake.removed_adapters == ["sql-lora"]
    assert (await gw.admin("DELETE", "/admin/adapters/sql-lora"))[0] == 404
    async with gw.state.db.session() as s:
        rows = (await s.scalars(select(AuditLog).where(AuditLog.target == "sql-lora"))).all()
    assert [row.action for row in rows] == ["adapter.create", "adapter.delete"]


async def test_adapters_survive_a_restart(make_gateway, adapter_dir, tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'kept.db'}"
    gw = await make_gateway(database_url=url)
    await gw.tenant("a")
    assert (await register(gw, "a-lora", adapter_dir, tenant="a"))[0] == 201
    await gw.server.close()
    again = await make_gateway(database_url=url)
    assert again.state.adapters.visible("a-lora", None) is None  # the tenant's, not public
    [adapter] = again.state.adapters.all()
    assert (adapter.name, adapter.path, adapter.base_model) == ("a-lora", adapter_dir, "fake-model")


async def eventually(check) -> bool:
    """check(), polled until it holds, for at most 10 s."""
    for _ in range(200):
        if check():
            return True
        await asyncio.sleep(0.05)
    return check()


@pytest.mark.pg
async def test_the_registry_on_postgresql(pg_schema, make_gateway, adapter_dir):
    db = {"database_url": PG_URL, "database_schema": pg_schema}
    gw = await make_gateway(**db)
    _, key = await gw.tenant("a")
    assert (await register(gw, "a-lora", adapter_dir, tenant="a"))[0] == 201
    assert (await register(gw, "a-lora", adapter_dir))[0] == 400
    assert (await gw.chat(key, model="a-lora")).status == 200
    second = await make_gateway(**db)  # another gateway on the same database loads it
    assert [a.name for a in second.state.adapters.all()] == ["a-lora"]
    # and reads the table again: what the first registers or deletes reaches it
    assert (await register(gw, "public", adapter_dir))[0] == 201
    assert await eventually(lambda: second.state.adapters.visible("public", None) is not None)
    assert (await gw.admin("DELETE", "/admin/adapters/public"))[0] == 200
    assert await eventually(lambda: second.state.adapters.visible("public", None) is None)
    assert await eventually(lambda: second.backend("fake").removed_adapters == ["public"])
    # deleting the tenant drops its adapters (the rows cascade)
    status, _ = await gw.admin("DELETE", f"/admin/tenants/{(await gw.tenant('b'))[0]['id']}")
    assert status == 200
    tenant_id = gw.state.adapters.all()[0].tenant_id
    assert (await gw.admin("DELETE", f"/admin/tenants/{tenant_id}"))[0] == 200
    assert gw.state.adapters.all() == []
    async with gw.state.db.session() as s:
        assert await s.scalar(select(func.count()).select_from(LoraAdapter)) == 0


async def test_lora_modules_from_the_config(make_gateway, adapter_dir, tmp_path):
    spec = BackendSpec("fake", "fake", "", "fake-model")
    spec.lora_modules = [LoraModule("sql-lora", adapter_dir), LoraModule("bad", "/no/such/dir")]
    gw = await make_gateway([spec])
    _, key = await gw.tenant()
    models = await models_of(gw, key)
    assert models["sql-lora"]["parent"] == "fake-model"
    assert "bad" not in models  # refused by the replica's check: logged, not served
    assert (await gw.chat(key, model="sql-lora")).status == 200
    status, body = await gw.admin("DELETE", "/admin/adapters/sql-lora")
    assert status == 400 and "config" in body["error"]["message"]


def test_lora_modules_parse_in_vllms_forms(tmp_path):
    config = tmp_path / "kvgate.toml"
    config.write_text(
        """
[[backends]]
name = "gpu0"
type = "gpu"
model = "m"
lora_modules = ["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}']

[[backends]]
name = "vllm"
type = "remote"
model = "llama"
options.url = "http://127.0.0.1:9/v1"
lora_modules = [{name = "sql-up", path = "sql-lora"}]
"""
    )
    gpu, remote = load_settings(config, environ={}).resolved_backends()
    assert gpu.lora_modules == [LoraModule("sql", "/a/sql"), LoraModule("chat", "/a/chat", "m")]
    assert gpu.options == {"enable_lora": True}  # an adapter given implies it
    assert remote.lora_modules == [LoraModule("sql-up", "sql-lora")]
    assert "enable_lora" not in remote.options and "lora_modules" not in remote.options
    flags = {"backend": "gpu", "lora_modules": ["x=/p"], "max_loras": 2, "max_lora_rank": 16}
    [one] = load_settings(None, flags, environ={}).resolved_backends()
    assert one.lora_modules == [LoraModule("x", "/p")]
    assert one.options == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    with pytest.raises(ValueError, match="NAME=PATH"):
        load_settings(
            None, {"backend": "gpu", "lora_modules": ["nopath"]}, environ={}
        ).resolved_backends()
    with pytest.raises(ValueError, match="need the gpu backend"):
        load_settings(
            None, {"backend": "local", "max_lora_rank": 8}, environ={}
        ).resolved_backends()
    assert build_parser().parse_args(["serve", "--lora-modules", "a=/x", "b=/y"]).lora_modules == [
        "a=/x",
        "b=/y",
    ]


async def test_the_adapters_cli(make_gateway, adapter_dir, capsys):
    gw = await make_gateway()
    await gw.tenant("a")
    common = ["--url", gw.url, "--key", ADMIN_KEY]

    def kvgate(*args: str) -> int:
        return cli_main(["adapters", *args, *common])

    add = ["add", "a-lora", adapter_dir, "--base-model", "fake-model", "--tenant", "a"]
    assert await asyncio.to_thread(kvgate, *add) == 0
    assert (
        await asyncio.to_thread(kvgate, "add", "x", "/no/such", "--base-model", "fake-model") == 1
    )
    assert "no such path" in capsys.readouterr().err
    assert await asyncio.to_thread(kvgate, "list", "--json") == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert (listed["name"], listed["base_model"]) == ("a-lora", "fake-model")
    assert await asyncio.to_thread(kvgate, "delete", "a-lora") == 0
    assert gw.state.adapters.all() == []


def _stats(name: str, load: int = 0, loaded: tuple[str, ...] = ()) -> BackendStats:
    return BackendStats(name, True, running=load, extra={"adapters_loaded": list(loaded)})


def test_the_router_prefers_a_replica_with_the_adapter_loaded():
    router = Router([], "prefix")
    # equal load: the one holding the adapter, whatever the turn
    picks = {
        router.choose([_stats("r-0"), _stats("r-1", loaded=("a",))], [], "a") for _ in range(4)
    }
    assert picks == {1}
    # a little busier still wins: a load costs more than a request's wait
    assert router.choose([_stats("r-0"), _stats("r-1", 3, ("a",))], [], "a") == 1
    # past the balance rule (more than 4 and 1.5 times the least loaded): the least loaded
    assert router.choose([_stats("r-0", 1), _stats("r-1", 6, ("a",))], [], "a") == 0
    # another adapter loaded is no reason
    assert router.choose([_stats("r-0"), _stats("r-1", 1, ("b",))], [], "a") == 0
    # round robin and least_loaded ignore it
    assert (
        Router([], "least_loaded").choose([_stats("r-0"), _stats("r-1", 1, ("a",))], [], "a") == 0
    )


async def test_a_third_party_upstream_gets_the_adapters_upstream_name(make_gateway):
    async with BareUpstream() as up:
        spec = BackendSpec("up", "remote", "gemma", "", {"urls": [up.url]})
        spec.lora_modules = [LoraModule("sql", "sql-lora-upstream")]
        gw = await make_gateway([spec])
        (remote,) = gw.state.backends
        while not remote.stats().healthy:  # the health watch's first answer
            await asyncio.sleep(0.05)
        _, key = await gw.tenant()
        assert (await models_of(gw, key))["sql"]["parent"] == "gemma"
        r = await gw.chat(key, model="sql", max_tokens=2)
        assert r.status == 200 and (await r.json())["model"] == "sql"
        r = await gw.chat(key, model="gemma", max_tokens=2)
        assert r.status == 200
        assert [b["model"] for b in up.bodies] == ["sql-lora-upstream", UPSTREAM_ID]


def test_lora_flag_defaults_are_the_engines():
    from backend_gpu.config import EngineConfig as GpuConfig
    from backend_local.config import EngineConfig as LocalConfig

    gpu = {f.name: f.default for f in dataclasses.fields(GpuConfig)}
    local = {f.name: f.default for f in dataclasses.fields(LocalConfig)}
    assert {k: gpu[k] for k in LORA_DEFAULTS} == LORA_DEFAULTS
    assert local["max_loras"] == LORA_DEFAULTS["max_loras"]
    assert (gpu["enable_lora"], local["enable_lora"]) == (False, False)
