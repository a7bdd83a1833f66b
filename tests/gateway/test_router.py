"""The router: the scoring rule on real catalogs and stats, then two in-process gpu
replicas of a tiny model behind the gateway, called with the openai client."""

from __future__ import annotations

import asyncio
import time

import pytest
from openai import AsyncOpenAI

from gateway.backends import BackendSpec, BackendStats, KVEvent, build_backends
from gateway.cli import build_parser
from gateway.config import Settings
from gateway.config_load import load_settings
from gateway.routing.catalog import PrefixCatalog
from gateway.routing.router import Candidate, Router
from gateway.routing.salts import tenant_cache_salt
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.gateway.conftest import fake_backends

HASHES = [f"h{i}" for i in range(8)]


def catalog_holding(holdings: dict[str, int], lower: dict[str, int] | None = None) -> PrefixCatalog:
    """A catalog where each replica holds the first n of HASHES (applied as KV events) on
    its device, and the first n of `lower` in the tiers under it."""
    catalog = PrefixCatalog()
    for medium, held in (("device", holdings), ("lower", lower or {})):
        for replica, n in held.items():
            catalog.apply(
                KVEvent(
                    "stored", replica, h, HASHES[i - 1] if i else None, "s", 16, time.time(), medium
                )
                for i, h in enumerate(HASHES[:n])
            )
    return catalog


def stats(name: str, load: int = 0, kv_usage: float = 0.0) -> BackendStats:
    running, waiting = min(load, 2), max(load - 2, 0)  # two run at once, the rest queue
    return BackendStats(name=name, running=running, waiting=waiting, kv_usage=kv_usage)


def test_prefix_policy_prefers_the_replica_holding_the_prefix():
    router = Router([], "prefix", catalog_holding({"r-0": 2, "r-1": 6}))
    assert router.choose([stats("r-0"), stats("r-1", load=3)], HASHES) == 1
    # a longer match wins over a shorter one whatever the order
    router = Router([], "prefix", catalog_holding({"r-0": 6, "r-1": 2}))
    assert router.choose([stats("r-0", load=2), stats("r-1")], HASHES) == 0


def test_prefix_policy_spreads_when_the_holder_is_far_busier():
    router = Router([], "prefix", catalog_holding({"r-0": 8}), balance_abs=4, balance_rel=1.5)
    # 4 more requests than the other replica is still worth the cached prefill ...
    assert router.choose([stats("r-0", load=5), stats("r-1", load=1)], HASHES) == 0
    # ... 5 more (and more than 1.5x) is not
    assert router.choose([stats("r-0", load=6), stats("r-1", load=1)], HASHES) == 1
    # both conditions must hold: 10 vs 7 differs by 3 only
    assert router.choose([stats("r-0", load=10), stats("r-1", load=7)], HASHES) == 0


def test_a_small_match_or_none_goes_to_the_least_loaded():
    router = Router([], "prefix", catalog_holding({"r-0": 3}), cache_threshold=0.5)
    # 3 of 8 blocks is under the threshold: the load decides
    assert router.choose([stats("r-0", load=2), stats("r-1", load=1)], HASHES) == 1
    assert router.choose([stats("r-0", load=1), stats("r-1", load=1, kv_usage=0.5)], HASHES) == 0
    # equally loaded: the partial match breaks the tie, every time
    assert {router.choose([stats("r-1"), stats("r-0")], HASHES) for _ in range(4)} == {1}
    # no catalog entry at all, equal replicas: they take turns
    router = Router([], "prefix", PrefixCatalog())
    picks = {router.choose([stats("r-0"), stats("r-1")], HASHES) for _ in range(4)}
    assert picks == {0, 1}


def test_a_prefix_in_a_lower_tier_ranks_below_the_device_and_above_nothing():
    only_lower = Router([], "prefix", catalog_holding({}, lower={"r-0": 8}))
    # r-0 holds the prefix in host memory or on disk, r-1 nothing; equal load: r-0, always
    picks = {only_lower.choose([stats("r-1"), stats("r-0")], HASHES) for _ in range(4)}
    assert picks == {1}
    # ... however busy, up to the balance rule, as a device hit would be
    assert only_lower.choose([stats("r-0", load=5), stats("r-1", load=1)], HASHES) == 0
    assert only_lower.choose([stats("r-0", load=6), stats("r-1", load=1)], HASHES) == 1
    # the same blocks on one's device and in the other's lower tier: the device wins
    both = Router([], "prefix", catalog_holding({"r-1": 8}, lower={"r-0": 8}))
    assert {both.choose([stats("r-0"), stats("r-1")], HASHES) for _ in range(4)} == {1}
    assert {both.choose([stats("r-1"), stats("r-0")], HASHES) for _ in range(4)} == {0}
    # a longer prefix in the tiers beats a shorter one on a device: it saves more prefill
    longer = Router([], "prefix", catalog_holding({"r-1": 4}, lower={"r-0": 8}))
    assert longer.choose([stats("r-0"), stats("r-1")], HASHES) == 0
    # device and tier together: 3 on the device and the next 5 down there cover all 8
    split = catalog_holding({"r-0": 3, "r-1": 6}, lower={"r-0": 8})
    assert split.match_tiers("r-0", HASHES) == (8, 3)
    assert Router([], "prefix", split).choose([stats("r-0"), stats("r-1")], HASHES) == 0
    # under the threshold, a partial lower-tier match still breaks a tie in load
    small = Router([], "prefix", catalog_holding({}, lower={"r-0": 2}), cache_threshold=0.5)
    assert {small.choose([stats("r-1"), stats("r-0")], HASHES) for _ in range(4)} == {1}


def test_round_robin_and_least_loaded_ignore_the_catalog():
    catalog = catalog_holding({"r-0": 8})
    rr = Router([], "round_robin", catalog)
    assert [rr.choose([stats("r-0"), stats("r-1")], HASHES) for _ in range(4)] == [0, 1, 0, 1]
    least = Router([], "least_loaded", catalog)
    assert least.choose([stats("r-0", load=1), stats("r-1")], HASHES) == 1
    with pytest.raises(ValueError, match="router_policy"):
        Router([], "random")


def test_a_burst_picked_from_stale_stats_is_spread_by_the_requests_in_flight():
    """Every request of a burst reads the replicas' stats before any reaches a replica:
    without counting what the gateway itself sent, all would go to the one that looked
    idlest (here by KV usage)."""
    replicas = build_backends(BackendSpec("fk", "fake", "", "m", {"replicas": 2}))
    router = Router(replicas, "prefix")
    idle = [
        Candidate(replicas[0], stats("fk-0", 0, 0.1)),
        Candidate(replicas[1], stats("fk-1", 0, 0.2)),
    ]
    assert {router.pick_from(idle, []).name for _ in range(4)} == {"fk-0"}  # unclaimed
    picked = []
    for _ in range(8):  # as admission.prepare does: pick, then claim
        b = router.pick_from(idle, [])
        router.claim(b)
        picked.append(b.name)
    assert sorted(picked.count(n) for n in ("fk-0", "fk-1")) == [4, 4]
    for name in picked:
        router.release(next(b for b in replicas if b.name == name))
    assert router.in_flight == {"fk-0": 0, "fk-1": 0}


def test_replicas_option_builds_named_adapters():
    spec = BackendSpec("fk", "fake", "", "m", {"replicas": 3})
    assert [b.name for b in build_backends(spec)] == ["fk-0", "fk-1", "fk-2"]
    assert [b.name for b in build_backends(BackendSpec("fk", "fake", "", "m"))] == ["fk"]
    with pytest.raises(ValueError, match="replicas"):
        build_backends(BackendSpec("fk", "fake", "", "m", {"replicas": 0}))


async def test_a_request_reads_each_replicas_stats_once(make_gateway, monkeypatch):
    gw = await make_gateway(fake_backends(replicas=3))
    reads = {b.name: 0 for b in gw.state.backends}
    for b in gw.state.backends:

        def counted(b=b, read=b.stats):
            reads[b.name] += 1
            return read()

        monkeypatch.setattr(b, "stats", counted)
    _, key = await gw.tenant("acme")
    r = await gw.chat(key)
    assert r.status == 200, await r.text()
    assert reads == {"fake-0": 1, "fake-1": 1, "fake-2": 1}


async def test_a_replica_failing_before_any_output_is_retried_on_another(make_gateway):
    gw = await make_gateway(fake_backends(replicas=2))
    failing = gw.backend("fake-0")
    failing.fail_rate = 1.0  # healthy by its stats, but every request fails at once
    tenant, key = await gw.tenant("acme")
    for stream in (False, True, False, True):
        r = await gw.chat(key, max_tokens=3, stream=stream)
        assert r.status == 200, await r.text()
        assert "error" not in await r.text()
    _, usage = await gw.admin("GET", "/admin/usage")
    assert usage["total"]["requests"] == 4 and usage["total"]["completion_tokens"] == 12
    assert gw.backend("fake-1").running == 0


async def test_with_no_replica_left_the_failure_reaches_the_client(make_gateway):
    gw = await make_gateway(fake_backends(replicas=2))
    for b in gw.state.backends:
        b.fail_rate = 1.0
    _, key = await gw.tenant("acme")
    r = await gw.chat(key, max_tokens=3)
    assert r.status == 503 and (await r.json())["error"]["type"] == "service_unavailable"


# -- two gpu replicas behind the gateway --------------------------------------------------

PROMPT = " ".join(["Paged attention stores keys and values in fixed-size blocks."] * 3)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("router-model")))


async def two_replicas(make_gateway, model_dir: str, **engine):
    options = {"replicas": 2, "max_num_batched_tokens": 64, "seed": 1, **engine}
    gw = await make_gateway([BackendSpec("tiny", "gpu", model_dir, "tiny", options)])
    tenant, key = await gw.tenant("acme")
    client = AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    return gw, tenant, client


async def complete(client, suffix: str, max_tokens: int = 2):
    ignore_eos = {"ignore_eos": True}  # every request generates all max_tokens
    prompt = PROMPT + suffix
    return await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=ignore_eos
    )


async def prompt_hashes(gw, tenant: dict, text: str) -> list[str]:
    backend = gw.state.backends[0]
    tokens = await backend.render("tiny", text)
    return backend.block_hashes(tokens, tenant_cache_salt(gw.state.secret, tenant["id"]))


async def holder(gw, hashes: list[str]) -> str:
    """The one replica the catalog says holds the prompt's blocks (waits for the events)."""
    catalog = gw.state.router.catalog
    for _ in range(100):
        holders = [b.name for b in gw.state.backends if catalog.match(b.name, hashes)]
        if holders:
            assert len(holders) == 1, holders
            return holders[0]
        await asyncio.sleep(0.05)
    raise AssertionError("no KV event reached the catalog")


def load(backend) -> int:
    s = backend.stats()
    return s.running + s.waiting


@pytest.mark.slow
async def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(make_gateway, tiny_llama):
    gw, tenant, client = await two_replicas(make_gateway, tiny_llama)
    replicas = {b.name: b for b in gw.state.backends}
    assert set(replicas) == {"tiny-0", "tiny-1"}
    first = await complete(client, " Question zero?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hashes = await prompt_hashes(gw, tenant, PROMPT)
    home = await holder(gw, hashes)
    for i in range(4):
        out = await complete(client, f" Question {i + 1}?")
        assert out.usage.prompt_tokens_details.cached_tokens > 0
    other = next(name for name in replicas if name != home)
    assert replicas[other].stats().prefix_queries == 0  # it never saw a request
    assert gw.state.router.catalog.match(other, hashes) == 0


@pytest.mark.slow
async def test_requests_spread_when_the_holder_is_saturated(make_gateway, tiny_llama):
    gw, tenant, client = await two_replicas(make_gateway, tiny_llama, max_num_seqs=2)
    await complete(client, " Warm up.")
    home = await holder(gw, await prompt_hashes(gw, tenant, PROMPT))
    replicas = {b.name: b for b in gw.state.backends}
    other = next(name for name in replicas if name != home)
    # long requests, one at a time once the router can see the last one in the stats:
    # they queue on the holder until it is 5 requests busier than the other replica
    tasks: list[asyncio.Task] = []
    for i in range(8):
        tasks.append(asyncio.create_task(complete(client, f" Long {i}.", max_tokens=100)))
        for _ in range(100):
            if sum(map(load, replicas.values())) >= sum(not t.done() for t in tasks):
                break
            await asyncio.sleep(0.02)
    outs = await asyncio.gather(*tasks)
    cached = [o.usage.prompt_tokens_details.cached_tokens for o in outs]
    assert sum(c > 0 for c in cached) >= 5, cached  # the holder took its share first ...
    assert replicas[other].stats().prefix_queries > 0, cached  # ... then the other
    assert 0 in cached


def test_replicas_and_router_policy_settings():
    environ = {
        "KVGATE_BACKEND": "fake",
        "KVGATE_REPLICAS": "2",
        "KVGATE_ROUTER_POLICY": "round_robin",
    }
    settings = load_settings(environ=environ)
    assert settings.router_policy == "round_robin"
    (spec,) = settings.resolved_backends()
    assert [b.name for b in build_backends(spec)] == ["fake-0", "fake-1"]
    with pytest.raises(ValueError, match="router_policy"):
        load_settings(environ={"KVGATE_ROUTER_POLICY": "random"})
    with pytest.raises(ValueError, match="replicas"):
        load_settings(environ={"KVGATE_REPLICAS": "0"})
    with pytest.raises(ValueError, match="replicas must be an integer"):
        Settings(backends=[BackendSpec("e", "gpu", "", "m", {"replicas": "two"})])
    args = build_parser().parse_args(
        ["serve", "--replicas", "3", "--router-policy", "least_loaded"]
    )
    assert (args.replicas, args.router_policy) == (3, "least_loaded")
