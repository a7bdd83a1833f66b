"""A client that hangs up mid-stream is billed for what it received, exactly once, on
every kind of backend: the fake engine, the gpu engine (a tiny model on the CPU), the
llama.cpp engine (the default model) and a `kvgate worker` process, each behind a real
`kvgate serve`, the `openai` client as the caller. (A third-party upstream, whose chunks
carry no token ids, is in test_hostile_upstream.py.)

The usage row says 499, and its completion tokens lie between the chunks the client
read and max_tokens; the tenant's token counter holds the row's tokens, once.
"""

from __future__ import annotations

import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.backends.default_model import default_model_path
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.conftest import LiveGateway, free_port, start_gateway
from tests.gateway.test_remote import (
    MODEL,
    TOKEN,
    backend_health,
    remote_config,
    start_worker,
    wait_until,
)

MAX_TOKENS = 200
READ = 3  # chunks the client reads before it leaves


def fake_config() -> str:
    return (
        '[[backends]]\nname = "fake"\ntype = "fake"\nserved_model_name = "m"\n'
        "options = { tokens_per_second = 50 }\n"
    )


def gpu_config(model: str) -> str:
    return f'[[backends]]\nname = "gpu"\ntype = "gpu"\nmodel = "{model}"\nserved_model_name = "m"\n'


def local_config() -> str:
    return (
        f'[[backends]]\nname = "local"\ntype = "local"\nmodel = "{default_model_path()}"\n'
        'served_model_name = "m"\n'
        "options = { n_ctx = 1024, n_parallel = 1, n_batch = 128, n_threads = 1 }\n"
    )


@pytest.fixture
def served(request, tmp_path: Path) -> Iterator[LiveGateway]:
    """A gateway over the backend kind the test names."""
    kind = request.param
    worker: subprocess.Popen | None = None
    if kind == "worker":
        port = free_port()
        worker = start_worker(tmp_path, port)
        urls = [f"http://127.0.0.1:{port}/v1"]
        config = remote_config(urls, api_key=TOKEN, upstream_model=MODEL)
        config = config.replace(f'model = "{MODEL}"', 'model = "m"', 1)
    elif kind == "gpu":
        config = gpu_config(save_tiny_model("llama", str(tmp_path)))
    else:
        config = fake_config() if kind == "fake" else local_config()
    gw = start_gateway(tmp_path, config=config, timeout=120)
    try:
        wait_until(lambda: all(backend_health(gw).values()), "the backend is healthy")
        yield gw
    finally:
        gw.stop()
        if worker is not None:
            worker.kill()
            worker.wait()


KINDS = ["fake", "gpu", pytest.param("local", marks=pytest.mark.slow), "worker"]


@pytest.mark.parametrize("served", KINDS, indirect=True)
def test_a_client_that_hangs_up_is_billed_for_what_it_received(served: LiveGateway):
    gw = served
    tenant, key = gw.tenant_key("hangs-up", max_concurrent=1)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    stream = client.completions.create(
        model="m",
        prompt="Once upon a time",
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    read = [chunk for _, chunk in zip(range(READ), stream, strict=False)]
    stream.close()
    db = Path(gw.env["KVGATE_DATABASE_URL"].split(":///")[1])
    sql = "SELECT status, prompt_tokens, completion_tokens, counted_by FROM usage_records WHERE tenant_id = ?"
    rows: list = []

    def landed() -> bool:
        nonlocal rows
        with sqlite3.connect(db) as conn:
            rows = conn.execute(sql, (tenant["id"],)).fetchall()
        return bool(rows)

    wait_until(landed, "the usage row")
    ((status, prompt, completion, counted_by),) = rows
    assert status == 499 and counted_by == "engine"
    assert len(read) == READ and READ <= completion < MAX_TOKENS
    stats = httpx.get(gw.url + "/admin/stats", headers=gw.admin_headers).json()
    quota = next(t for t in stats["tenants"] if t["id"] == tenant["id"])["quota"]
    assert quota["daily_used"] == prompt + completion
    # exactly once: the slot is back, and the next request adds its own row alone
    client.completions.create(model="m", prompt="Once", max_tokens=2)
    wait_until(lambda: landed() and len(rows) == 2, "the second row")
    assert rows[0] == (status, prompt, completion, counted_by)
