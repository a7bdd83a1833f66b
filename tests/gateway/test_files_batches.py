"""The Files and Batch APIs (issue 50) through the real `openai` client against a real
`kvgate serve --backend fake`: files tenant-scoped, bad JSONL lines named, limits, a batch
run to its output file with a usage row a line at the batch price, cancel, and a gateway
killed with SIGKILL that resumes its batch and bills each line once."""

from __future__ import annotations

import io
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.schemas.responses_admin import StatsSnapshot
from tests.conftest import LiveGateway, start_gateway

PRICES = """
[prices."fake-model"]
input = 2.0
output = 4.0
"""


def _line(i: int, url: str = "/v1/chat/completions", **body) -> dict:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": f"hi {i}"}]} | body
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def _jsonl(lines: list) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def _client(gw: LiveGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def _wait(
    client: openai.OpenAI, batch_id: str, until=("completed", "failed", "expired", "cancelled")
):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def _cli(gw: LiveGateway, *args: str, ok: bool = True) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], env=gw.env, capture_output=True, text=True
    )
    assert (run.returncode == 0) == ok, run.stderr
    return run.stdout + run.stderr


def _usage_rows(db: Path, batch_id: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        q = "SELECT custom_id, spend_nano_usd, prompt_tokens, completion_tokens FROM usage_records WHERE batch_id = ?"
        return conn.execute(q, (batch_id,)).fetchall()


@pytest.fixture
def gateway(tmp_path: Path):
    gw = start_gateway(tmp_path, "--backend", "fake", config=PRICES)
    yield gw
    gw.stop()


def test_files_are_tenant_scoped_and_batches_run_with_the_openai_client(gateway, tmp_path):
    # batch lines are no requests of the tenant's rpm or tpm: its own requests still pass
    _, key_a = gateway.tenant_key("acme", rpm=2, tpm=100_000, daily_tokens=1_000_000)
    _, key_b = gateway.tenant_key("other")
    a, b = _client(gateway, key_a), _client(gateway, key_b)
    f = a.files.create(
        file=("in.jsonl", io.BytesIO(_jsonl([_line(i) for i in range(3)]))), purpose="batch"
    )
    assert f.purpose == "batch" and f.bytes > 0 and f.filename == "in.jsonl"
    assert a.files.retrieve(f.id).id == f.id
    assert [x.id for x in a.files.list()] == [f.id]
    assert list(b.files.list()) == []
    for call in (b.files.retrieve, b.files.content, b.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    # stored under its id, never its client's name, in a 0700 directory
    files = tmp_path / "kvgate-files"
    assert (files / f.id).read_bytes() == a.files.content(f.id).content
    assert files.stat().st_mode & 0o777 == 0o700

    if time.time() % 60 > 50:  # the batch and the chat after it in one rate window
        time.sleep(60.5 - time.time() % 60)
    batch = a.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(batch.id)
    done = _wait(a, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed) == (3, 3)
    assert done.error_file_id is None
    out = [json.loads(x) for x in a.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2"]
    first = out[0]["response"]
    assert first["status_code"] == 200 and first["body"]["object"] == "chat.completion"
    assert first["request_id"] == first["body"]["id"] and out[0]["error"] is None
    # one usage row a line, named by batch and custom_id, at half the model's price
    rows = _usage_rows(tmp_path / "kvgate.db", batch.id)
    assert sorted(r[0] for r in rows) == ["req-0", "req-1", "req-2"]
    for _, spend, prompt, completion in rows:
        full = prompt * 2000 + completion * 4000  # nanodollars at 2 and 4 USD a million
        assert spend == -(-full // 2) or spend == full // 2
    # the dashboard's data: the batch's progress, files and spend at the batch price; and
    # its lines filled none of the tenant's per-minute windows (tpm, rpm)
    stats = httpx.get(gateway.url + "/admin/stats", headers=gateway.admin_headers).json()
    StatsSnapshot.model_validate(stats)  # as the OpenAPI document says it
    (panel,) = stats["batches"]
    assert panel["id"] == batch.id and panel["tenant"] == "acme"
    assert panel["status"] == "completed" and panel["endpoint"] == "/v1/chat/completions"
    assert panel["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert (panel["output_file_id"], panel["error_file_id"]) == (done.output_file_id, None)
    assert panel["billed_lines"] == 3
    assert panel["billed_tokens"] == sum(p + c for _, _, p, c in rows)
    assert panel["spend"] == pytest.approx(sum(r[1] for r in rows) / 1e9)
    quota = next(t["quota"] for t in stats["tenants"] if t["name"] == "acme")
    assert (quota["tpm_used"], quota["rpm_used"]) == (0, 0)
    assert quota["daily_used"] == panel["billed_tokens"]  # budgets count them
    assert [x.id for x in a.batches.list()] == [batch.id]
    assert list(b.batches.list()) == []
    with pytest.raises(openai.ConflictError):
        a.batches.cancel(batch.id)
    chat = a.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "x"}]
    )
    assert chat.choices[0].message.content
    # the operator's view: `kvgate batches` and batch work apart in `kvgate usage`
    shown = json.loads(_cli(gateway, "--json", "batches", "show", batch.id))
    assert shown["status"] == "completed" and shown["request_counts"]["completed"] == 3
    assert batch.id in _cli(gateway, "batches", "list", "--tenant", "acme")
    assert batch.id not in _cli(gateway, "batches", "list", "--tenant", "other")
    usage = _cli(gateway, "usage")
    assert "batch work" in usage and batch.id in usage
    assert "cannot be cancelled" in _cli(gateway, "batches", "cancel", batch.id, ok=False)
    a.files.delete(f.id)
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(f.id)
    assert not (files / f.id).exists()


def test_bad_lines_are_named_and_limits_hold(tmp_path):
    gw = start_gateway(
        tmp_path,
        "--backend",
        "fake",
        extra_env={"KVGATE_MAX_FILE_LINES": "5", "KVGATE_MAX_FILE_BYTES": "200000"},
    )
    try:
        _, key = gw.tenant_key("acme")
        c = _client(gw, key)
        bad = [
            _line(0),
            {"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}},
            _line(0),
        ]
        raw = _jsonl(bad)[:-1] + b"\nnot json\n" + b"[" * 100_000 + b"\n"
        with pytest.raises(openai.BadRequestError) as e:
            c.files.create(file=("in.jsonl", io.BytesIO(raw)), purpose="batch")
        message = e.value.body["message"]
        assert "line 2: method" in message and "line 3: custom_id 'req-0' is not unique" in message
        assert "line 4: not JSON" in message and "line 1" not in message
        assert "line 5: nested too deep" in message
        with pytest.raises(openai.BadRequestError, match="at most 5"):
            c.files.create(
                file=("in.jsonl", io.BytesIO(_jsonl([_line(i) for i in range(6)]))), purpose="batch"
            )
        with pytest.raises(openai.APIStatusError) as big:
            c.files.create(file=("in.jsonl", io.BytesIO(b"x" * 300_000)), purpose="batch")
        assert big.value.status_code == 413 and "file field" in big.value.message
        with pytest.raises(openai.BadRequestError, match="purpose"):
            c.files.create(file=("in.jsonl", io.BytesIO(_jsonl([_line(0)]))), purpose="fine-tune")
        f = c.files.create(file=("in.jsonl", io.BytesIO(_jsonl([_line(0)]))), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="lines 1"):
            c.batches.create(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
            )
        assert list(c.files.list()) and list(c.batches.list()) == []
    finally:
        gw.stop()
