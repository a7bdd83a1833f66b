"""The gateway's side of the tiers under a gpu engine's KV cache (issue 33): their flags
and options reach the EngineConfig, their counters reach /metrics and the admin stats
(through a `kvgate worker` too), and the medium of a KV event crosses the worker's wire."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from prometheus_client import generate_latest

from backend_gpu.config import EngineConfig
from engine_api.block_hash import hash_blocks
from engine_api.records import BackendStats, KVEvent
from gateway.backends.remote_worker import WorkerEvents, parse_stats
from gateway.cli import build_parser
from gateway.config_load import load_settings
from gateway.observe.metrics import Metrics, kv_tier_stats
from gateway.routing.catalog import PrefixCatalog
from gateway.worker import cli as worker_cli
from gateway.worker.events import EventLog
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.gateway.test_worker import gen_body, http, start_worker

REDIS = "redis://127.0.0.1:6379/3"


def settings_for(*argv: str, environ: dict[str, str] | None = None):
    args = build_parser().parse_args(list(argv))
    return load_settings(None, worker_cli.engine_overrides(args), environ=environ or {})


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_tier_flags_reach_the_engine_config(command, tmp_path):
    argv = ["--kv-offload-gb", "0.5", "--kv-disk-path", str(tmp_path), "--kv-disk-gb", "2"]
    (spec,) = settings_for(
        command, "--backend", "gpu", *argv, "--kv-shared-url", REDIS
    ).resolved_backends()
    assert spec.options == {
        "kv_offload_gb": 0.5,
        "kv_disk_path": str(tmp_path),
        "kv_disk_gb": 2.0,
        "kv_shared_url": REDIS,
    }
    config = EngineConfig("model", device="cpu", **spec.options)
    assert (config.kv_offload_gb, config.kv_disk_path) == (0.5, str(tmp_path))
    assert (config.kv_disk_gb, config.kv_shared_url) == (2.0, REDIS)
    # unset: the engine's defaults (no tier; 16 GiB once a disk path is given)
    (spec,) = settings_for(command, "--backend", "gpu").resolved_backends()
    assert not {k for k in spec.options if k.startswith("kv_")}


def test_tier_settings_from_the_environment_and_a_backends_entry(tmp_path):
    env = {"KVGATE_BACKEND": "gpu", "KVGATE_KV_DISK_PATH": str(tmp_path / "kv")}
    env |= {"KVGATE_KV_DISK_GB": "0.25", "KVGATE_KV_SHARED_URL": REDIS}
    (spec,) = load_settings(None, environ=env).resolved_backends()
    assert spec.options == {
        "kv_disk_path": str(tmp_path / "kv"),
        "kv_disk_gb": 0.25,
        "kv_shared_url": REDIS,
    }
    config = tmp_path / "kvgate.toml"
    config.write_text(
        '[[backends]]\nname = "g"\ntype = "gpu"\nmodel = "m"\n'
        f'options = {{ kv_offload_gb = 1, kv_disk_path = "{tmp_path}", kv_shared_url = "{REDIS}" }}\n'
    )
    (spec,) = load_settings(config, environ={}).resolved_backends()
    engine = EngineConfig("m", device="cpu", **spec.options)
    assert (engine.kv_offload_gb, engine.kv_disk_path, engine.kv_shared_url) == (
        1,
        str(tmp_path),
        REDIS,
    )


def test_the_disk_flags_set_the_local_backends_tier_too(tmp_path):
    from backend_local.config import EngineConfig as LocalConfig

    argv = ["--backend", "local", "--kv-disk-path", str(tmp_path), "--kv-disk-gb", "4"]
    (spec,) = settings_for("worker", *argv).resolved_backends()
    assert spec.options == {"kv_disk_path": str(tmp_path), "kv_disk_gb": 4.0}
    config = LocalConfig("model.gguf", **spec.options)
    assert (config.kv_disk_path, config.kv_disk_gb) == (str(tmp_path), 4.0)


def test_tier_flags_are_refused_where_the_backend_has_no_such_tier(tmp_path):
    with pytest.raises(ValueError, match=r"\['kv_shared_url'\] need the gpu backend, not 'fake'"):
        settings_for("serve", "--backend", "fake", "--kv-shared-url", REDIS).resolved_backends()
    local = settings_for("serve", "--backend", "local", "--kv-offload-gb", "1")
    with pytest.raises(ValueError, match=r"\['kv_offload_gb'\] need the gpu backend, not 'local'"):
        local.resolved_backends()
    fake = settings_for("serve", "--backend", "fake", "--kv-disk-path", str(tmp_path))
    with pytest.raises(ValueError, match=r"\['kv_disk_path'\] need the gpu or local backend"):
        fake.resolved_backends()
    with pytest.raises(SystemExit):  # not a number
        build_parser().parse_args(["worker", "--kv-offload-gb", "lots"])


# -- counters: /metrics and the admin stats ---------------------------------------------


def tiered_stats(name: str = "g0") -> BackendStats:
    extra = {"num_blocks": 10, "kv_host_hits": 64, "kv_host_blocks": 3, "kv_host_bytes": 12288}
    extra |= {"kv_host_blocks_written": 9, "kv_host_blocks_loaded": 8}
    extra |= {"kv_disk_hits": 16, "kv_disk_blocks": 40, "kv_disk_bytes": 163840}
    extra |= {"kv_disk_blocks_written": 40, "kv_disk_rejected": 2, "kv_disk_write_errors": 1}
    extra |= {"kv_shared_hits": 8, "kv_shared_blocks_written": 5, "kv_shared_rejected": 0}
    extra |= {"kv_shared_errors": 3}
    return BackendStats(name=name, extra=extra)


def scrape(*stats: BackendStats) -> str:
    return generate_latest(Metrics(lambda: stats).registry).decode()


def test_metrics_per_tier():
    text = scrape(tiered_stats(), BackendStats(name="plain"))
    for sample in (
        'kvgate:kv_tier_hit_tokens_total{backend="g0",tier="host"} 64.0',
        'kvgate:kv_tier_hit_tokens_total{backend="g0",tier="disk"} 16.0',
        'kvgate:kv_tier_hit_tokens_total{backend="g0",tier="shared"} 8.0',
        'kvgate:kv_tier_blocks{backend="g0",tier="disk"} 40.0',
        'kvgate:kv_tier_bytes{backend="g0",tier="host"} 12288.0',
        'kvgate:kv_tier_blocks_written_total{backend="g0",tier="shared"} 5.0',
        'kvgate:kv_tier_blocks_loaded_total{backend="g0",tier="host"} 8.0',
        'kvgate:kv_tier_rejected_blocks_total{backend="g0",tier="disk"} 2.0',
        'kvgate:kv_tier_errors_total{backend="g0",tier="disk"} 1.0',
        'kvgate:kv_tier_errors_total{backend="g0",tier="shared"} 3.0',
    ):
        assert sample in text, sample
    assert 'backend="plain",tier=' not in text  # no tier on: no series
    assert "kvgate:kv_tier" not in scrape(BackendStats(name="plain"))
    # a backend reports only what its tier counts: the disk's blocks are never "loaded"
    assert 'kv_tier_blocks_loaded_total{backend="g0",tier="disk"}' not in text


def test_admin_stats_name_each_tier():
    tiers = kv_tier_stats(tiered_stats().extra)
    assert list(tiers) == ["host", "disk", "shared"]
    assert tiers["host"] == {
        "hits": 64,
        "blocks": 3,
        "bytes": 12288,
        "blocks_written": 9,
        "blocks_loaded": 8,
    }
    assert tiers["shared"] == {"hits": 8, "blocks_written": 5, "rejected": 0, "errors": 3}
    assert kv_tier_stats({"num_blocks": 10, "kv_disk_hits": True}) == {}  # not a count


async def test_admin_stats_and_backends_carry_the_tiers(make_gateway, monkeypatch):
    gw = await make_gateway()
    (backend,) = gw.state.backends
    monkeypatch.setattr(backend, "stats", lambda: tiered_stats(backend.name))
    _, snap = await gw.admin("GET", "/admin/stats")
    (row,) = snap["backends"]
    assert row["kv_tiers"] == kv_tier_stats(tiered_stats().extra)
    _, listed = await gw.admin("GET", "/admin/backends")
    assert listed["data"][0]["kv_tiers"]["disk"]["blocks"] == 40
    monkeypatch.undo()
    _, snap = await gw.admin("GET", "/admin/stats")
    assert snap["backends"][0]["kv_tiers"] == {}  # the fake backend has none


# -- through a worker process -----------------------------------------------------------

BS = 8
BLOCK_BYTES = (
    2 * 2 * BS * 2 * 16 * 4
)  # the tiny llama's block: layers x K,V x rows x heads x dims x 4


@pytest.mark.slow
async def test_a_gpu_workers_host_tier_counters_reach_the_gateway(tmp_path):
    """--kv-offload-gb on `kvgate worker`: prefixes that overflow a 10-block device pool
    come back from host memory, the worker's stats carry the tier to /metrics, and its
    KV events tell a catalog which blocks are down there."""
    model = save_tiny_model("llama", str(tmp_path))
    options = {"block_size": BS, "max_model_len": 64, "kv_cache_memory_bytes": 10 * BLOCK_BYTES}
    args = ["--backend", "gpu", "--model", model, "--served-model-name", "tiny"]
    args += ["--device", "cpu", "--kv-offload-gb", str(64 * BLOCK_BYTES / (1 << 30))]
    w = start_worker(tmp_path, *args, "--options", json.dumps(options))
    rng = random.Random(33)
    prompts = [[rng.randrange(4, 384) for _ in range(41)] for _ in range(4)]
    try:
        async with http(w) as c:
            cached = 0
            for prompt in prompts * 2:  # the second round finds them down in the tier
                r = await c.post("/kvgate/v1/generate", json=gen_body(prompt, 2, model="tiny"))
                assert r.status_code == 200
                cached += json.loads(r.text.splitlines()[-1])["usage"]["cached_tokens"]
            stats = parse_stats((await c.get("/kvgate/v1/stats")).json(), "w0", "worker")
            catalog = await catalog_of(c, [hashes_of(p) for p in prompts])
    finally:
        w.stop()
    # the catalog learnt where the blocks are: every prompt's 5 full blocks in some
    # tier, not all of them on the 10-block device
    held = [catalog.match_tiers("w0", hashes_of(p)) for p in prompts]
    assert all(anywhere == 5 for anywhere, _ in held), held
    assert any(device < 5 for _, device in held) and sum(d for _, d in held) <= 10, held
    tiers = kv_tier_stats(stats.extra)
    assert list(tiers) == ["host"]  # the only tier on
    host = tiers["host"]
    assert host["blocks_loaded"] > 0 and host["hits"] == host["blocks_loaded"] * BS
    assert 0 < host["hits"] <= cached
    assert host["bytes"] == host["blocks"] * BLOCK_BYTES > 0
    text = scrape(stats)
    assert f'kvgate:kv_tier_hit_tokens_total{{backend="w0",tier="host"}} {host["hits"]}.0' in text


def hashes_of(prompt: list[int]) -> list[str]:
    return [h.hex() for h in hash_blocks(prompt, BS, None)]


async def catalog_of(c, prompts: list[list[str]]) -> PrefixCatalog:
    """A catalog fed the worker's KV events (a snapshot, as a gateway's first poll gets)
    once they say where every prompt's blocks are: the lower tier's are written by a
    thread, so they may come after the replies."""
    deadline = time.monotonic() + 60
    while True:
        events = WorkerEvents("w0")
        events.apply((await c.get("/kvgate/v1/kv_events", params={"epoch": "?"})).json(), "w")
        catalog = PrefixCatalog()
        catalog.apply(events.take())
        covered = [catalog.match_tiers("w0", hashes)[0] for hashes in prompts]
        if covered == [len(h) for h in prompts] or time.monotonic() > deadline:
            return catalog
        await asyncio.sleep(0.1)


# -- the medium over the worker's event wire --------------------------------------------


def event(kind: str, block: str, medium: str = "device") -> KVEvent:
    return KVEvent(kind, "r", block, None, None, 16, 0.0, medium)


async def test_the_worker_event_log_keeps_each_medium_apart():
    log = EventLog("e1")
    log.append([event("stored", "a"), event("stored", "a", "lower"), event("removed", "a")])
    log.append([event("stored", "b", "lower")])
    snapshot = await log.poll("e0", 0, 0)  # another epoch: a resync
    assert snapshot.resync
    assert sorted((e.block_hash, e.medium) for e in snapshot.events) == [
        ("a", "lower"),
        ("b", "lower"),
    ]
    # and a reader of the wire gets the same records back, medium included
    wire = json.loads(json.dumps(snapshot.to_dict()))
    reader = WorkerEvents("w0")
    reader.apply(wire, "worker")
    assert reader.held == {("lower", "a"), ("lower", "b")}
    # a later resync that no longer has "a" in the lower tier removes it from there
    log.append([event("removed", "a", "lower"), event("stored", "a")])
    reader.apply(json.loads(json.dumps((await log.poll("e0", 0, 0)).to_dict())), "worker")
    removed = [(e.block_hash, e.medium) for e in reader.take() if e.kind == "removed"]
    assert removed == [("a", "lower")]
    assert reader.held == {("lower", "b"), ("device", "a")}


def test_an_event_of_an_unknown_medium_is_refused():
    reply = {"epoch": "e1", "seq": 1, "resync": False, "events": [event("stored", "a").to_dict()]}
    reply["events"][0]["medium"] = "tape"
    with pytest.raises(Exception, match="unknown kind or medium"):
        WorkerEvents("w0").apply(reply, "worker")
    old = event("stored", "a").to_dict()
    del old["medium"]  # a worker from before the tiers: its events are the device's
    assert KVEvent.from_dict(old).medium == "device"
