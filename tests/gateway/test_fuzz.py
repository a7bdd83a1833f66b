"""schemathesis against a live `kvgate serve --backend fake`, driven by the gateway's own
/openapi.json, on SQLite and on PostgreSQL: no 5xx, no response whose status, content
type or body breaks the document, no route that ignores its key, nothing deleted that
can still be read, no request left hanging (one that takes longer than
REQUEST_TIMEOUT_S fails the run) and no exception in the server's log.

Two runs per gateway, one after the other: the OpenAI-compatible and public routes with
a tenant's key, then the admin routes with the admin key, which then sees the usage,
pins and traffic the first run left. One run with both keys would let the fuzzer delete
the very tenant whose key it goes on using. Each run has a time budget (RUN_S); the
seed is fixed so that a failure shows again, and KVGATE_FUZZ_SEED picks another.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ADMIN_KEY, PG_URL, LiveGateway, start_gateway

# 20 s, not 30: the examples and coverage phases (the schema's own and boundary
# values) end in about 7 s either way; the rest of the budget is random fuzzing and
# stateful sequences (about 2,300 tenant and 1,900 admin cases in 20 s, against
# 4,100 and 2,900 in 30)
RUN_S = 20
REQUEST_TIMEOUT_S = 10
CHECKS = ",".join(
    [
        "not_a_server_error",
        "response_schema_conformance",
        "status_code_conformance",
        "content_type_conformance",
        "ignored_auth",  # a route that declares bearerAuth refuses a request without it
        "use_after_free",  # what was deleted stays deleted
    ]
)
# Ollama's model-management routes answer 501 by design, which the fuzzer counts as a
# server error: they are tested in tests/gateway/test_ollama_api.py
TENANT_PATHS = (
    "^/(v1/|api/(?!pull|push|create|copy|delete)|tokenize|detokenize|health|ready|openapi)"
)
SEED = os.environ.get("KVGATE_FUZZ_SEED", "20261130")
# the stats stream never ends: one event is enough to check, then the fuzzer hangs up
CONFIG = """
request-timeout = {timeout}
headers = {{ Authorization = "Bearer {key}" }}

[[operations]]
include-path = "/admin/stats/stream"
max-stream-events = 1
"""


def _schemathesis(gw: LiveGateway, tmp_path: Path, name: str, key: str, paths: str) -> None:
    config = tmp_path / f"{name}.toml"
    config.write_text(CONFIG.format(timeout=REQUEST_TIMEOUT_S, key=key))
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run"]
    cmd += [gw.url + "/openapi.json", "--include-path-regex", paths, "--checks", CHECKS]
    cmd += ["--max-time", str(RUN_S), "--seed", SEED, "--generation-database", "none"]
    cmd += ["--no-color"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_S + 120, cwd=tmp_path)
    assert gw.proc.poll() is None, gw.log.read_text()[-5000:]
    assert run.returncode == 0, f"schemathesis ({name}):\n{run.stdout[-30000:]}{run.stderr}"


def _fuzz(gw: LiveGateway, tmp_path: Path) -> None:
    try:
        _, key = gw.tenant_key("fuzz")
        _schemathesis(gw, tmp_path, "tenant", key, TENANT_PATHS)
        _schemathesis(gw, tmp_path, "admin", ADMIN_KEY, "^/(admin/|metrics)")
    finally:
        gw.stop()
    assert _tracebacks(gw.log.read_text()) == []


def _tracebacks(log: str) -> list[str]:
    """The server's logged exceptions, but for aiohttp's on requests that are not HTTP
    at all (schemathesis probes whether a header may hold a NUL byte), answered 400."""
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", log)
    return [r for r in records if "Traceback" in r and "http_exceptions.BadHttpMessage" not in r]


def test_fuzz_on_sqlite(tmp_path):
    _fuzz(start_gateway(tmp_path, "--backend", "fake"), tmp_path)


@pytest.mark.pg
def test_fuzz_on_postgresql(tmp_path, pg_schema):
    env = {"KVGATE_DATABASE_SCHEMA": pg_schema}
    gw = start_gateway(tmp_path, "--backend", "fake", database_url=PG_URL, extra_env=env)
    _fuzz(gw, tmp_path)
