"""What a new user meets following the README (issues 31 and 46): a gateway that cannot
serve exits and says why; the command line takes tenants by name; errors say what to do
next; start-up shows the admin key, not other libraries' logs (unless --verbose); a fresh
database comes with a starter tenant's key beside the admin key; a bare `kvgate serve`
serves a model that chats."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.backends.default_model import (
    DEFAULT_MODEL_ID,
    EMBEDDING_MODEL_ID,
    INSTRUCT_MODEL_ID,
    model_path,
)
from gateway.cli import main as kvgate
from gateway.cli.chat import ChatError, RemoteChat, Sampling
from gateway.config_backends import pick_backend_type
from gateway.config_load import load_settings
from tests.conftest import ADMIN_KEY, free_port, start_gateway

MISSING = "path/that/does/not/exist.gguf"


def serve_once(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """`kvgate serve` on a free port and a fresh database, run until it exits."""
    env = dict(os.environ) | {
        "KVGATE_ADMIN_KEY": ADMIN_KEY,
        "KVGATE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}",
    }
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(free_port()), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.parametrize("workers", [[], ["--workers", "1"]], ids=["in-process", "workers"])
def test_a_backend_that_cannot_start_ends_serve_in_one_line(tmp_path, workers) -> None:
    out = serve_once(tmp_path, "--backend", "local", "--model", MISSING, *workers)
    assert out.returncode == 1, out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, out.stderr
    assert errors[0].startswith("kvgate: ") and "nothing to serve" in errors[0]
    assert f"not found: {MISSING}" in errors[0]
    assert "Traceback" not in out.stderr and "listening on" not in out.stdout


def test_a_failed_backends_traceback_is_for_verbose(tmp_path) -> None:
    out = serve_once(tmp_path, "--backend", "local", "--model", MISSING, "--verbose")
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "ModelLoadError" in out.stderr
    assert out.stderr.rstrip().splitlines()[-1].endswith("nothing to serve")


def test_start_up_is_quiet_and_verbose_shows_the_rest(tmp_path) -> None:
    (tmp_path / "quiet").mkdir()
    (tmp_path / "loud").mkdir()
    # new files named here: start_gateway's own databases come migrated (tests/migrated_db.py)
    new = {d: f"sqlite+aiosqlite:///{tmp_path / d / 'kvgate.db'}" for d in ("quiet", "loud")}
    quiet = start_gateway(tmp_path / "quiet", "--backend", "fake", database_url=new["quiet"])
    quiet.stop()
    text = quiet.log.read_text()
    assert "alembic" not in text.lower() and " INFO " not in text, text
    assert all(line.startswith("kvgate: ") for line in text.splitlines()), text
    loud = start_gateway(
        tmp_path / "loud", "--backend", "fake", "--verbose", database_url=new["loud"]
    )
    loud.stop()
    assert "alembic.runtime.migration INFO" in loud.log.read_text()


def test_workers_are_named_by_address_and_start_quietly(tmp_path) -> None:
    gw = start_gateway(tmp_path, "--backend", "fake", "--workers", "2", timeout=120)
    try:
        backends = httpx.get(gw.url + "/admin/backends", headers=gw.admin_headers).json()
        names = [b["name"] for b in backends["data"]]
        # as docs/prefix-caching.md's "Replicas and cache-aware routing" names them
        assert len(names) == 2 and all(re.fullmatch(r"fake@127\.0\.0\.1:\d+", n) for n in names)
        log = gw.log.read_text()
        assert "worker 0:" not in log and "worker 1:" not in log, log  # their output: --verbose
    finally:
        gw.stop()


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    assert kvgate(["--database-url", url, "db", "upgrade"]) == 0
    return url


def cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    status = kvgate(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_the_command_line_takes_a_tenants_name(db_url, capsys) -> None:
    base = ["--database-url", db_url]
    status, out, _ = cli(capsys, *base, "--json", "tenants", "create", "acme")
    tenant_id = json.loads(out)["id"]
    status, out, _ = cli(capsys, *base, "keys", "create", "acme", "--name", "batch-job")
    assert status == 0 and f"for tenant acme ({tenant_id})" in out
    for argv in (
        ["keys", "list", "acme"],
        ["keys", "list", "--tenant", "acme"],
        ["usage", "--tenant", "acme"],
        ["tenants", "update", "acme", "--rpm", "5"],
    ):
        status, out, err = cli(capsys, *base, *argv)
        assert status == 0 and err == "", argv
    status, out, _ = cli(capsys, *base, "--json", "keys", "list", "acme")
    assert [k["tenant_id"] for k in json.loads(out)] == [tenant_id]
    status, out, _ = cli(capsys, *base, "--json", "tenants", "list")
    assert json.loads(out)[0]["rpm"] == 5
    status, out, err = cli(capsys, *base, "keys", "create", "nobody")
    assert status == 1 and err.strip() == "kvgate: no tenant 'nobody'" and out == ""
    status, out, _ = cli(capsys, *base, "--json", "tenants", "delete", "acme")
    assert json.loads(out) == {"id": tenant_id, "object": "tenant", "deleted": True}


def test_a_new_key_shows_the_limits_it_was_given(db_url, capsys) -> None:
    base = ["--database-url", db_url]
    cli(capsys, *base, "tenants", "create", "acme")
    flags = ["--rpm", "60", "--daily-tokens", "200000", "--daily-spend", "1.5"]
    status, out, _ = cli(capsys, *base, "keys", "create", "acme", *flags, "--models", "a,b")
    assert status == 0
    assert "limits: rpm 60, daily_tokens 200000, daily_spend 1.5, models a,b" in out
    key = out.splitlines()[-2].strip()
    assert key.startswith("kvg-") and "shown only once" in out.splitlines()[-1]
    status, out, _ = cli(capsys, *base, "keys", "create", "acme")  # none: no limits line
    assert status == 0 and "limits" not in out


async def test_prefixes_takes_a_tenants_name(make_gateway, capsys) -> None:
    gw = await make_gateway()
    tenant, key = await gw.tenant("acme")
    argv = ["prefixes", "--url", gw.url, "--key", ADMIN_KEY, "--tenant"]
    assert await asyncio.to_thread(kvgate, [*argv, "acme"]) == 0
    assert "per tenant" in capsys.readouterr().out
    assert await asyncio.to_thread(kvgate, [*argv, "nobody"]) == 1
    assert capsys.readouterr().err.strip() == "kvgate: 404: no tenant 'nobody'"


def test_chat_that_cannot_reach_the_gateway_names_url_and_kvgate_url() -> None:
    chat = RemoteChat(f"http://127.0.0.1:{free_port()}", "kvg-x", None, Sampling(8, None))
    with pytest.raises(ChatError) as info:
        chat.start()
    chat.close()
    assert "--url" in str(info.value) and "$KVGATE_URL" in str(info.value)


def test_top_with_a_tenants_key_stops_and_asks_for_the_admin_key(live_gateway) -> None:
    _, key = live_gateway.tenant_key("acme")
    for bad, status in ((key, "403"), ("kvg-wrong", "401")):
        out = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "top", "--url", live_gateway.url]
            + ["--admin-key", bad],
            capture_output=True,
            text=True,
            timeout=60,  # a hang (the old endless retries) fails here rather than never
        )
        assert out.returncode == 1, out.stdout + out.stderr
        errors = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and f"HTTP {status}" in errors[0], out.stderr
        assert "needs the gateway's admin key" in errors[0] and "KVGATE_ADMIN_KEY" in errors[0]


def _printed(log: str, name: str) -> str:
    """The key a first start printed as `export NAME=kvg-...`."""
    found = re.findall(rf"^    export {name}=(kvg-[\w-]+)$", log, re.MULTILINE)
    assert len(found) == 1, log
    return found[0]


def test_a_fresh_database_prints_a_starter_tenants_key_once(tmp_path) -> None:
    env = {"KVGATE_ADMIN_KEY": ""}  # none configured: the first start makes one
    gw = start_gateway(tmp_path, "--backend", "fake", extra_env=env)
    try:
        first = gw.log.read_text()
        admin, key = _printed(first, "ADMIN"), _printed(first, "KEY")
        assert "shown only this once" in first and '"starter"' in first
        # the tenant's key calls a model at once: no admin call first
        models = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert models.status_code == 200 and models.json()["data"], models.text
        # the admin key is refused there, with how to make a tenant's key
        refused = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {admin}"})
        message = refused.json()["error"]["message"]
        assert refused.status_code == 403
        assert "kvgate keys create" in message and "/admin/tenants/{tenant_id}/keys" in message
    finally:
        gw.stop()
    again = start_gateway(tmp_path, "--backend", "fake", extra_env=env)
    try:
        assert "export" not in again.log.read_text()  # once: only the hashes are kept
        tenants = httpx.get(
            again.url + "/admin/tenants", headers={"Authorization": f"Bearer {admin}"}
        )
        assert [t["name"] for t in tenants.json()["data"]] == ["starter"]
    finally:
        again.stop()


def test_a_configured_admin_key_makes_no_starter_tenant(live_gateway) -> None:
    log = live_gateway.log.read_text()
    assert "export" not in log and "starter" not in log
    tenants = httpx.get(live_gateway.url + "/admin/tenants", headers=live_gateway.admin_headers)
    assert tenants.json()["data"] == []


def test_a_bare_serve_serves_an_instruct_model_first() -> None:
    kind = pick_backend_type()
    specs = load_settings(None, environ={}).resolved_backends(starter=True)
    served = [(s.type, s.served_model_name or s.model) for s in specs]
    assert served == [
        (kind, INSTRUCT_MODEL_ID),  # first: what `kvgate chat` and /v1/models lead with
        (kind, DEFAULT_MODEL_ID),
        ("gpu", EMBEDDING_MODEL_ID),
    ]
    assert model_path(INSTRUCT_MODEL_ID).endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    # anything named keeps one entry as before: a backend, a model, an engine flag, workers
    for given in ({"backend": kind}, {"model": "m.gguf"}, {"workers": 2}, {"replicas": 2}):
        (one,) = load_settings(None, given, environ={}).resolved_backends(starter=True)
        assert one.model in ("", "m.gguf"), given
    (worker,) = load_settings(None, environ={}).resolved_backends()  # kvgate worker's
    assert worker.model == ""
