"""Batch lines yield on a remote upstream (issue 50): the gateway holds them back in its
fair queue (the entry's `max_in_flight`) while an interactive request of the same tenant
waits there, and the runner starts no new line meanwhile. On real processes: a
`kvgate serve` in front of llama-cpp-python's own server (a third-party upstream) and in
front of a `kvgate worker`, the `openai` client as the caller.

The measure is an order, not a time: from the moment an interactive request is sent
until it is answered, at most the line that held the upstream's one slot, the one that
took it before the request arrived, and one whose count was still being written may
finish. Without priorities in the queue the tenant's own queued lines (five here) would
all go first."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway.backends.default_model import default_model_path
from tests.conftest import LiveGateway, free_port, start_gateway
from tests.gateway.test_remote import (
    MODEL,
    PROMPT,
    TOKEN,
    backend_health,
    remote_config,
    start_worker,
    wait_until,
)
from tests.gateway.upstream_servers import llama_cpp_python_server

LINES = 12
IN_FLIGHT = 6  # the runner's lines at once: one at the upstream, five queued
SERVER = f"[server]\nbatch_in_flight = {IN_FLIGHT}\n\n"


@contextlib.contextmanager
def _third_party(tmp: Path) -> Iterator[LiveGateway]:
    with llama_cpp_python_server(tmp, MODEL) as url:
        config = remote_config(
            [url + "/v1"],
            context_length=2048,
            tokenizer=str(default_model_path()),
            read_timeout_s=60,
            max_in_flight=1,
        )
        gw = start_gateway(tmp, config=SERVER + config, timeout=300)
        try:
            yield gw
        finally:
            gw.stop()


@contextlib.contextmanager
def _worker(tmp: Path) -> Iterator[LiveGateway]:
    port = free_port()
    worker = start_worker(tmp, port, tokens_per_second=40)
    try:
        urls = [f"http://127.0.0.1:{port}/v1"]
        config = remote_config(urls, api_key=TOKEN, max_in_flight=1)
        gw = start_gateway(tmp, config=SERVER + config)
        try:
            yield gw
        finally:
            gw.stop()
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.parametrize("upstream", [_third_party, _worker], ids=["llama-cpp-python", "worker"])
def test_an_interactive_request_goes_ahead_of_its_tenants_queued_lines(tmp_path, upstream):
    with upstream(tmp_path) as gw:
        wait_until(lambda: all(backend_health(gw).values()), "the upstream is healthy")
        _, key = gw.tenant_key("acme")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        lines = [
            {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": body}
            for i in range(LINES)
        ]
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        f = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )

        def counts() -> int:
            return client.batches.retrieve(batch.id).request_counts.completed

        wait_until(lambda: counts() >= 1, "a line is answered", timeout=120)
        before = counts()  # the runner has its lines in flight: one upstream, the rest queued
        answer = client.completions.create(**body)
        during = counts() - before
        assert answer.choices[0].text and answer.usage.completion_tokens > 0
        assert during <= 3, f"{during} lines went ahead of the interactive request"
        deadline = time.monotonic() + 300
        while (done := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.2)
        assert done.request_counts.completed == LINES  # the rest ran once it was served
