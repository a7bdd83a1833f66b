"""The Grafana dashboard (deploy/grafana/kvgate.json) queries only what kvgate exports: a
gateway on a real socket serves streams (a prefix cached) and a refusal to a tenant, its
/metrics is scraped, and every metric name in every query of the dashboard is there with
a sample. The spend it charts is what the usage rows say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ADMIN_KEY
from tests.gateway.conftest import fake_backends

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvgate.json"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression the dashboard runs: its panels' and its variables'."""
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    found += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return found


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for needed in ("throughput", "first token", "per output token", "waiting", "kv cache"):
        assert needed in titles, needed
    assert "service by tenant" in titles and "spend by tenant" in titles
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"


async def test_every_metric_the_dashboard_queries_is_exported(make_gateway) -> None:
    prices = {"fake-model": {"input": 3.0, "output": 15.0}}
    gw = await make_gateway(fake_backends(max_in_flight=2), prices=prices)
    tenant, key = await gw.tenant("acme", rpm=3)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    for _ in range(3):
        stream = await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "tell me a story " * 20}],  # cached
            max_tokens=6,
            stream=True,
        )
        assert len([c async for c in stream if c.choices]) >= 2
    refused = False
    for _ in range(5):  # the fourth in a minute: a refusal, counted by tenant and limit
        try:
            await client.completions.create(model="fake-model", prompt="x", max_tokens=1)
        except openai.RateLimitError:
            refused = True
            break
    assert refused
    async with gw.http.get(gw.url + "/metrics", headers=ADMIN) as r:
        scraped = await r.text()
    _, usage = await gw.admin("GET", f"/admin/usage?tenant_id={tenant['id']}")
    samples = {s.name for family in text_string_to_metric_families(scraped) for s in family.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    names = {n for q in queries(dashboard) for n in re.findall(r"kvgate:[A-Za-z0-9_:]+", q)}
    assert len(names) >= 15
    missing = sorted(names - samples)
    assert missing == [], missing
    spent = [
        s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "kvgate:spend_usd_total" and s.labels["tenant"] == "acme"
    ]
    assert spent and abs(sum(spent) - usage["total"]["spend"]) < 1e-9 and sum(spent) > 0
