"""Batches that outlive their gateway and their budget (issue 50): a gateway killed with
SIGKILL mid-batch resumes it once restarted and bills each line once; cancel, expiry and
a budget that runs out close the rest of a batch unrun and unbilled; a batch line's
usage row committed twice (a line run again after a crash) is one row."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import select

from gateway.batches import store
from gateway.batches.jsonl import InputLine
from gateway.db import DailyUsage, UsageRecord
from gateway.tenancy.tenants import TenantService
from gateway.tenancy.usage import UsageRecorder, UsageRow
from tests.conftest import PG_URL, LiveGateway, start_gateway
from tests.gateway.test_files_batches import _cli, _client, _jsonl, _line, _wait

SLOW = """
[server]
batch_in_flight = {in_flight}

[[backends]]
name = "fake"
type = "fake"
model = "fake-model"
ttft_ms = {ttft_ms}
"""


def _slow(tmp_path: Path, ttft_ms: int, in_flight: int = 2) -> LiveGateway:
    # one instance name across restarts, as a deployment keeps it: a restarted gateway
    # takes its own batches back at once (another waits for their lease to lapse)
    config = SLOW.format(ttft_ms=ttft_ms, in_flight=in_flight)
    return start_gateway(tmp_path, config=config, extra_env={"KVGATE_INSTANCE": "gw-a"})


def _submit(client: openai.OpenAI, n: int) -> str:
    data = _jsonl([_line(i, max_tokens=4) for i in range(n)])
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def _billed(db: Path, batch_id: str) -> list[str]:
    with sqlite3.connect(db) as conn:
        q = "SELECT custom_id FROM usage_records WHERE batch_id = ? ORDER BY custom_id"
        return [r[0] for r in conn.execute(q, (batch_id,))]


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_gateway_killed_mid_batch_resumes_it_and_bills_each_line_once(tmp_path):
    gw = _slow(tmp_path, ttft_ms=300)
    try:
        _, key = gw.tenant_key("acme")
        batch_id = _submit(_client(gw, key), 8)
        _wait(_client(gw, key), batch_id, until=("in_progress",))
        deadline = time.monotonic() + 30
        while not _billed(tmp_path / "kvgate.db", batch_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        gw.stop(signal.SIGKILL)  # lines in flight, and lines not started
    finally:
        gw.stop()
    before = _billed(tmp_path / "kvgate.db", batch_id)
    assert 0 < len(before) < 8
    again = _slow(tmp_path, ttft_ms=0)  # the same database and files directory
    try:
        client = _client(again, key)
        done = _wait(client, batch_id)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (8, 0)
        out = _lines(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(8))
        assert done.error_file_id is None
        assert _billed(tmp_path / "kvgate.db", batch_id) == sorted(f"req-{i}" for i in range(8))
    finally:
        again.stop()


def test_cancel_leaves_the_rest_unrun_and_unbilled(tmp_path):
    gw = _slow(tmp_path, ttft_ms=400, in_flight=1)
    try:
        _, key = gw.tenant_key("acme")
        client = _client(gw, key)
        batch_id = _submit(client, 6)
        cancelling = client.batches.cancel(batch_id)
        assert cancelling.status == "cancelling"
        done = _wait(client, batch_id)
        assert done.status == "cancelled" and done.cancelled_at is not None
        ran = done.request_counts.completed
        assert ran < 6
        errors = _lines(client, done.error_file_id)
        assert len(errors) == 6 - ran
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        assert len(_billed(tmp_path / "kvgate.db", batch_id)) == ran
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(batch_id)
    finally:
        gw.stop()


def test_a_batch_past_its_window_expires_unbilled(tmp_path):
    gw = _slow(tmp_path, ttft_ms=300, in_flight=1)
    try:
        _, key = gw.tenant_key("acme")
        client = _client(gw, key)
        batch_id = _submit(client, 6)
        with sqlite3.connect(tmp_path / "kvgate.db") as conn:  # its 24 hours gone by
            conn.execute("UPDATE batches SET expires_at = 0 WHERE id = ?", (batch_id,))
        done = _wait(client, batch_id)
        assert done.status == "expired" and done.expired_at is not None
        errors = _lines(client, done.error_file_id)
        assert errors and {e["error"]["code"] for e in errors} == {"batch_expired"}
        ran = done.request_counts.completed
        assert ran + len(errors) == 6
        assert len(_billed(tmp_path / "kvgate.db", batch_id)) == ran
    finally:
        gw.stop()


def test_a_budget_that_runs_out_fails_the_rest_of_the_batch(tmp_path):
    gw = _slow(tmp_path, ttft_ms=0, in_flight=1)
    try:
        # rates do not hold batch lines (rpm 1); the daily token budget does
        _, key = gw.tenant_key("acme", rpm=1, daily_tokens=40)
        client = _client(gw, key)
        batch_id = _submit(client, 12)
        done = _wait(client, batch_id)
        assert done.status == "failed", done
        assert done.errors.data[0].code == "budget_exceeded"
        counts = done.request_counts
        assert counts.completed >= 2 and counts.completed + counts.failed == 12
        assert len(_billed(tmp_path / "kvgate.db", batch_id)) == counts.completed
        failed = _lines(client, done.error_file_id)
        assert len(failed) == counts.failed
        assert failed[0]["response"]["status_code"] == 429
    finally:
        gw.stop()


def _row(request_id: str, custom_id: str) -> UsageRow:
    return UsageRow(request_id, "t_1", "key_1", "fake-model", 10, 5, 0, 1.0, 2.0, 200, "stop",
                    batch_id="batch_1", custom_id=custom_id)  # fmt: skip


async def test_a_batch_line_billed_again_is_one_row(db):
    recorder = UsageRecorder(db)
    recorder.start()
    try:
        await recorder.submit(_row("chatcmpl-1", "a"))
        # run again after a crash: another request id, the same line; beside another line
        again, other = recorder.submit(_row("chatcmpl-2", "a")), recorder.submit(_row("c-3", "b"))
        await again
        await other
    finally:
        await recorder.stop()
    assert not recorder.kept
    async with db.session() as s:
        rows = (await s.scalars(select(UsageRecord))).all()
        daily = (await s.scalars(select(DailyUsage))).all()
    assert sorted((r.request_id, r.custom_id) for r in rows) == [("c-3", "b"), ("chatcmpl-1", "a")]
    assert [d.requests for d in daily] == [2]


def test_a_batch_on_postgresql_killed_and_resumed(tmp_path, pg_schema):
    env = {"KVGATE_DATABASE_SCHEMA": pg_schema, "KVGATE_FILES_DIR": str(tmp_path / "files")}
    env["KVGATE_INSTANCE"] = "gw-a"
    config = SLOW.format(ttft_ms=300, in_flight=2)
    gw = start_gateway(tmp_path, database_url=PG_URL, extra_env=env, config=config)
    try:
        _, key = gw.tenant_key("acme")
        client = _client(gw, key)
        batch_id = _submit(client, 6)
        deadline = time.monotonic() + 30
        while client.batches.retrieve(batch_id).request_counts.completed < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        gw.stop(signal.SIGKILL)
    finally:
        gw.stop()
    again = start_gateway(tmp_path, database_url=PG_URL, extra_env=env, config=config)
    try:
        client = _client(again, key)
        done = _wait(client, batch_id)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (6, 0)
        out = _lines(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(6))
        assert [b.id for b in client.batches.list(limit=1)] == [batch_id]
        usage = json.loads(_cli(again, "--json", "usage"))  # each line billed once
        assert [(b["batch_id"], b["lines"]) for b in usage["batches"]] == [(batch_id, 6)]
        # what PostgreSQL cannot store is refused or left out, never a 500
        with pytest.raises(openai.BadRequestError):
            client.batches.create(
                input_file_id="file-\x00", endpoint="/v1/completions", completion_window="24h"
            )
        part = b'Content-Disposition: form-data; name="file"; filename="a\x00b.jsonl"'
        form = b"--b\r\n" + part + b"\r\n\r\n" + _jsonl([_line(0)]) + b"\r\n--b\r\n"
        form += b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b--\r\n'
        raw = httpx.post(
            again.url + "/v1/files",
            content=form,
            headers={
                "Authorization": f"Bearer {key}",
                "Content-Type": "multipart/form-data; boundary=b",
            },
        )
        assert raw.status_code in (200, 400), raw.text
        if raw.status_code == 200:  # kept without what PostgreSQL cannot store
            assert client.files.retrieve(raw.json()["id"]).filename == "ab.jsonl"
    finally:
        again.stop()


async def test_one_gateway_runs_a_batch_until_its_lease_lapses(db) -> None:
    tenants = TenantService(db)
    tenant = await tenants.create_tenant("acme", {}, "test")
    batch = await store.create(
        db,
        tenant["id"],
        "key_1",
        "/v1/completions",
        "file-1",
        "24h",
        {},
        [InputLine("a", "/v1/completions", {})],
    )
    assert await store.claim(db, batch.id, "gw-a", 100.0, 30.0)
    assert not await store.claim(db, batch.id, "gw-b", 110.0, 30.0)  # gw-a holds it
    assert await store.claim(db, batch.id, "gw-a", 120.0, 30.0)  # renewed, or back after a restart
    assert not await store.claim(db, batch.id, "gw-b", 149.0, 30.0)
    assert await store.claim(db, batch.id, "gw-b", 151.0, 30.0)  # gw-a's lease lapsed
    assert not await store.claim(db, batch.id, "gw-a", 152.0, 30.0)


async def test_a_line_that_leaves_the_running_set_during_the_read_is_not_started_again(db):
    """The runner reads the pending lines while a running line's task writes its answer
    and leaves the running set: the line, still pending when the read began, is not
    handed out again (it was: a line run twice, billed once)."""
    tenant = await TenantService(db).create_tenant("acme", {}, "test")
    lines = [InputLine(c, "/v1/completions", {}) for c in ("a", "b", "c")]
    batch = await store.create(db, tenant["id"], "key_1", "/v1/completions", "f", "24h", {}, lines)
    running = {0}
    read = asyncio.create_task(store.pending(db, batch.id, running, 2))
    await asyncio.sleep(0)  # the read has begun: it waits on the database
    running.discard(0)  # line 0's task ended while the read was under way
    assert [line.custom_id for line in await read] == ["b", "c"]
