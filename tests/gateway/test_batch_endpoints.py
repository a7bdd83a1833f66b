"""A batch of each endpoint (issue 50): /v1/completions, /v1/messages and /v1/embeddings
lines answered in their route's own shape, each billed as a batch line; a line the route
would refuse is a failed line with the route's 400, beside the lines that ran."""

from __future__ import annotations

import io
import json
import sqlite3

import pytest

from tests.conftest import start_gateway
from tests.gateway.test_files_batches import _client, _jsonl, _wait

CONFIG = """
[[backends]]
name = "chat"
type = "fake"
model = "fake-model"

[[backends]]
name = "embed"
type = "fake"
model = "fake-embed"
task = "embed"
"""
BODIES = {
    "/v1/completions": {"model": "fake-model", "prompt": "Once", "max_tokens": 4},
    "/v1/messages": {
        "model": "fake-model",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/embeddings": {"model": "fake-embed", "input": ["a", "b"]},
}
SHAPE = {"/v1/completions": "text_completion", "/v1/messages": "message", "/v1/embeddings": "list"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gw = start_gateway(tmp_path_factory.mktemp("endpoints"), config=CONFIG)
    yield gw
    gw.stop()


@pytest.mark.parametrize("endpoint", list(BODIES))
def test_a_batch_of_each_endpoint(gateway, endpoint) -> None:
    _, key = gateway.tenant_key("t-" + endpoint.rsplit("/", 1)[1])
    client = _client(gateway, key)
    good = {"custom_id": "good", "method": "POST", "url": endpoint, "body": BODIES[endpoint]}
    bad = good | {"custom_id": "bad", "body": BODIES[endpoint] | {"model": 7}}
    f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl([good, bad]))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    done = _wait(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    [out] = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    body = out["response"]["body"]
    shape = body.get("object") or body.get("type")
    assert out["custom_id"] == "good" and shape == SHAPE[endpoint]
    [err] = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "model"
    db = gateway.env["KVGATE_DATABASE_URL"].removeprefix("sqlite+aiosqlite:///")
    with sqlite3.connect(db) as conn:
        q = "SELECT custom_id, request_id FROM usage_records WHERE batch_id = ?"
        assert conn.execute(q, (batch.id,)).fetchall() == [("good", out["response"]["request_id"])]
