"""Fair share through the gateway (issue 15): the tenant's weight reaches the engine, a
flooding tenant does not put another behind its queue, and /metrics shows each tenant's
service. The real `openai` client calls a real gpu engine with a tiny random model."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

from gateway.backends import BackendSpec
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.conftest import ADMIN_KEY


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("fair-model")))


async def _gateway(make_gateway, model_dir: str, fairness: str):
    options = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "seed": 1, "fairness": fairness}
    gw = await make_gateway([BackendSpec("tiny", "gpu", model_dir, "tiny", options)])
    clients = {}
    for name, weight in (("flood", 1.0), ("quiet", 2.0)):
        _, key = await gw.tenant(f"{name}-{fairness}", weight=weight)  # one database
        clients[name] = AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    return gw, clients


async def _finish_order(make_gateway, model_dir: str, fairness: str) -> tuple[list[str], int]:
    """The order in which the tenants' requests finished, and how many flood requests had
    finished when the quiet one was sent (on a loaded machine the flood may be ahead)."""
    gw, clients = await _gateway(make_gateway, model_dir, fairness)
    done: list[str] = []

    async def one(tenant: str, i: int) -> None:
        await clients[tenant].completions.create(
            model="tiny",
            prompt=f"request {i} of {tenant}",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        done.append(tenant)

    flood = [asyncio.create_task(one("flood", i)) for i in range(10)]
    engine = gw.backend("tiny")
    while engine.stats().waiting < 6:  # the flood is queued in the engine
        await asyncio.sleep(0.01)
    before = len(done)
    await one("quiet", 0)
    await asyncio.gather(*flood)
    return done, before


async def test_a_flood_does_not_queue_another_tenant_behind_it(make_gateway, tiny_llama):
    vtc, vtc_before = await _finish_order(make_gateway, tiny_llama, "vtc")
    fcfs, fcfs_before = await _finish_order(make_gateway, tiny_llama, "fcfs")
    # vtc admits the quiet tenant at the next free slot: behind the two running and the
    # two that took their slots while its request was on its way; fcfs serves it after
    # the whole queue (at least 6 waiting and the 2 running when it was sent)
    assert vtc.index("quiet") - vtc_before <= 4 < 8 <= fcfs.index("quiet") - fcfs_before


async def test_service_and_queues_per_tenant_in_metrics(make_gateway, tiny_llama):
    gw, clients = await _gateway(make_gateway, tiny_llama, "vtc")
    await clients["quiet"].completions.create(model="tiny", prompt="hello", max_tokens=4)
    tenants = {t["name"]: t["id"] for t in (await gw.admin("GET", "/admin/tenants"))[1]["data"]}
    tenant_stats = gw.backend("tiny").stats().extra["tenants"][tenants["quiet-vtc"]]
    assert tenant_stats["weight"] == 2.0 and tenant_stats["service"] > 0
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with gw.http.get(gw.url + "/metrics", headers=headers) as r:
        text = await r.text()
    labels = f'{{backend="tiny",tenant="{tenants["quiet-vtc"]}"}}'
    assert f"kvgate:tenant_service_tokens_total{labels}" in text
    assert f"kvgate:tenant_requests_waiting{labels} 0.0" in text


async def test_admin_stats_show_each_tenants_fair_share(make_gateway, tiny_llama):
    gw, clients = await _gateway(make_gateway, tiny_llama, "vtc")
    await clients["quiet"].completions.create(model="tiny", prompt="hello", max_tokens=4)
    _, snap = await gw.admin("GET", "/admin/stats")
    row = next(t for t in snap["tenants"] if t["name"] == "quiet-vtc")
    assert row["fair_share"]["service"] > 0 and row["fair_share"]["waiting"] == 0
