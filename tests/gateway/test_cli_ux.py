"""The first hour with the `kvgate` command: global flags after the subcommand, a taken
port said in one line, tables for people and JSON for scripts, unknown ids refused, and
the engine flags reaching the engines."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.backends import build_backend
from gateway.cli import build_parser
from gateway.cli import main as kvgate
from gateway.config_load import load_settings
from gateway.db import Database
from gateway.routing.fair_queue import SPARE_SEATS
from gateway.tenancy.quota.prices import Price
from gateway.tenancy.usage import UsageRecorder, UsageRow
from gateway.worker import cli as worker_cli
from tests.conftest import ADMIN_KEY


@pytest.fixture
def db_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A real SQLite file; no KVGATE_* from the caller's environment, and the default
    database (kvgate.db in the working directory) in tmp_path should a test miss it."""
    for name in list(os.environ):
        if name.startswith("KVGATE_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    status = kvgate(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def table(text: str) -> list[list[str]]:
    """A printed table's rows, split on runs of two or more spaces."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines()]


def test_global_flags_parse_before_and_after_the_subcommand() -> None:
    parse = build_parser().parse_args
    for argv in (
        ["--config", "f.toml", "serve"],
        ["serve", "--config", "f.toml"],
        ["tenants", "list", "--config", "f.toml"],
        ["tenants", "--config", "f.toml", "list"],
        ["worker", "--config", "f.toml"],
    ):
        assert parse(argv).config == "f.toml", argv
    assert parse(["serve"]).config is None
    assert parse(["tenants", "list"]).json is False
    assert parse(["--json", "tenants", "list"]).json is True
    assert parse(["tenants", "list", "--json"]).json is True
    args = parse(["usage", "--database-url", "sqlite+aiosqlite:///x.db", "--tenant", "t_1"])
    assert (args.database_url, args.tenant) == ("sqlite+aiosqlite:///x.db", "t_1")
    # given after the subcommand it wins over before, as later flags do
    assert parse(["--config", "a.toml", "serve", "--config", "b.toml"]).config == "b.toml"


def test_config_after_the_subcommand_reaches_the_database(tmp_path, db_url, capsys) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text(f'[server]\ndatabase_url = "{db_url}"\n')
    assert run(capsys, "tenants", "create", "acme", "--config", str(config))[0] == 0
    for argv in (
        ["tenants", "list", "--config", str(config)],
        ["--config", str(config), "tenants", "list"],
    ):
        status, out, _ = run(capsys, *argv)
        assert status == 0 and "acme" in out, argv
    # without it, the default database (empty) is used: the flag was what found acme
    status, out, _ = run(capsys, "tenants", "list")
    assert status == 0 and "acme" not in out and out.strip() == "(none)"


def test_a_taken_port_ends_serve_in_one_line(tmp_path, db_url) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "kvgate.toml"  # after the subcommand, as users type it
        config.write_text(f'[server]\nport = {port}\ndatabase_url = "{db_url}"\n')
        env = dict(os.environ) | {"KVGATE_ADMIN_KEY": ADMIN_KEY}
        out = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--backend", "fake"]
            + ["--config", str(config)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 1, out.stderr
    assert f"kvgate: port {port} is in use" in out.stderr
    assert "--port N" in out.stderr and "KVGATE_PORT=N" in out.stderr
    assert "Traceback" not in out.stderr and "listening on" not in out.stdout


async def _record_usage(db_url: str, tenant_id: str, key_id: str = "key-1", spend: int = 0) -> None:
    """One request's usage row, through the recorder the gateway uses."""
    db = Database(db_url)
    recorder = UsageRecorder(db)
    recorder.start()
    try:
        row = UsageRow("req-1", tenant_id, key_id, "fake-model", 7, 5, 2, 10.0, 50.0, 200, "stop")
        await recorder.submit(
            dataclasses.replace(row, created_at=time.time(), spend_nano_usd=spend, image_tokens=3)
        )
    finally:
        await recorder.stop()
        await db.close()


def test_tables_by_default_and_json_with_the_flag(db_url, capsys) -> None:
    base = ["--database-url", db_url]
    status, out, _ = run(capsys, *base, "tenants", "create", "acme", "--rpm", "5")
    rows = table(out)
    assert status == 0 and rows[0][:3] == ["id", "name", "created_at"] and "object" not in rows[0]
    assert rows[1][1] == "acme" and rows[1][0].startswith("t_")
    tenant_id = rows[1][0]
    status, out, _ = run(capsys, "tenants", "create", "globex", "--json", *base)
    assert status == 0 and json.loads(out)["name"] == "globex"

    status, out, _ = run(capsys, *base, "tenants", "list")
    assert status == 0 and [r[1] for r in table(out)[1:]] == ["acme", "globex"]
    status, out, _ = run(capsys, *base, "tenants", "list", "--json")
    assert [t["name"] for t in json.loads(out)] == ["acme", "globex"]

    status, out, _ = run(capsys, *base, "--json", "keys", "create", tenant_id)
    key_id = json.loads(out)["id"]
    status, out, _ = run(capsys, *base, "keys", "list", tenant_id)
    assert status == 0 and table(out)[1][0] == key_id and table(out)[0][0] == "id"
    status, out, _ = run(capsys, *base, "keys", "list", tenant_id, "--json")
    assert [k["id"] for k in json.loads(out)] == [key_id]

    status, out, _ = run(capsys, *base, "keys", "revoke", key_id)
    rows = table(out)
    assert status == 0 and rows[1][0] == key_id and rows[0][-1] == "revoked_at"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", rows[1][-1])  # a time, not "-"
    status, out, _ = run(capsys, *base, "keys", "revoke", key_id, "--json")
    assert json.loads(out)["revoked_at"] is not None

    asyncio.run(_record_usage(db_url, tenant_id))
    status, out, _ = run(capsys, *base, "usage")
    rows = table(out)
    assert status == 0 and rows[0][:3] == ["day", "tenant", "model"]
    assert rows[0][-2:] == ["image_tokens", "spend_usd"]
    assert rows[1][1:] == ["acme", "fake-model", "1", "7", "5", "2", "3", "0.00"]  # the name
    assert rows[2] == ["total", "1", "7", "5", "2", "3", "0.00"]
    status, out, _ = run(capsys, *base, "usage", "--json", "--tenant", tenant_id)
    usage = json.loads(out)
    assert usage["total"]["prompt_tokens"] == 7
    assert usage["data"][0]["tenant_id"] == tenant_id
    assert usage["data"][0]["tenant_name"] == "acme"

    status, out, _ = run(capsys, *base, "tenants", "delete", tenant_id, "--json")
    assert json.loads(out) == {"id": tenant_id, "object": "tenant", "deleted": True}


def test_unknown_ids_are_errors_everywhere(db_url, capsys) -> None:
    base = ["--database-url", db_url]
    assert run(capsys, *base, "db", "upgrade")[0] == 0
    for argv, message in (
        (["usage", "--tenant", "t_nonexistent"], "no tenant 't_nonexistent'"),
        (["keys", "list", "t_nonexistent"], "no tenant 't_nonexistent'"),
        (["keys", "create", "t_nonexistent"], "no tenant 't_nonexistent'"),
        (["tenants", "update", "t_nonexistent", "--rpm", "1"], "no tenant 't_nonexistent'"),
        (["tenants", "update", "t_nonexistent", "--rpm", "none"], "no tenant 't_nonexistent'"),
        (["keys", "list", "--tenant", "t_nonexistent"], "no tenant 't_nonexistent'"),
        (["keys", "update", "key_nonexistent", "--rpm", "1"], "no key 'key_nonexistent'"),
        (["tenants", "delete", "t_nonexistent"], "no tenant 't_nonexistent'"),
        (["keys", "revoke", "key_nonexistent"], "no key 'key_nonexistent'"),
        (["--json", "usage", "--tenant", "t_nonexistent"], "no tenant 't_nonexistent'"),
    ):
        status, out, err = run(capsys, *base, *argv)
        assert status == 1 and err.strip() == f"kvgate: {message}" and out == "", argv


def test_usage_shows_spend_per_tenant_and_key(db_url, capsys) -> None:
    base = ["--database-url", db_url, "--json"]
    tenant_id = json.loads(run(capsys, *base, "tenants", "create", "acme")[1])["id"]
    key = json.loads(run(capsys, *base, "keys", "create", tenant_id, "--name", "batch")[1])
    price = Price.from_usd_per_million(
        "fake-model", {"input": 3, "cached_input": 0.3, "output": 15}
    )
    spend = price.spend(7, 2, 5)  # the row's prompt, cached and completion tokens
    # $1 per million tokens is 1000 nanodollars a token
    assert spend == 5 * 3_000 + 2 * 300 + 5 * 15_000 == 90_600
    asyncio.run(_record_usage(db_url, tenant_id, key["id"], spend))

    status, out, _ = run(capsys, "--database-url", db_url, "usage")
    daily, per_tenant, per_key = (table(part) for part in out.split("\n\n"))
    assert daily[0][-1] == "spend_usd" and daily[1][-1] == daily[2][-1] == "0.0000906"
    assert per_tenant[0] == ["per tenant"] and per_tenant[1][0] == "tenant"
    assert per_tenant[2] == ["acme", "1", "7", "5", "2", "3", "0.0000906"]
    assert per_key[0] == ["per key"] and per_key[1][:3] == ["key", "name", "tenant"]
    assert per_key[2] == [key["id"], "batch", "acme", "1", "7", "5", "2", "3", "0.0000906"]

    usage = json.loads(run(capsys, *base, "usage", "--tenant", tenant_id)[1])
    assert usage["total"]["spend"] == usage["data"][0]["spend"] == spend / 1e9
    (per_tenant,) = usage["tenants"]
    assert per_tenant == {"tenant_id": tenant_id, "tenant_name": "acme"} | usage["total"]
    assert [(k["key_id"], k["name"], k["spend"]) for k in usage["keys"]] == [
        (key["id"], "batch", spend / 1e9)
    ]


def test_a_limit_is_lifted_from_the_command_line(db_url, capsys) -> None:
    base = ["--database-url", db_url, "--json"]
    status, out, _ = run(
        capsys, *base, "tenants", "create", "acme", "--rpm", "5", "--daily-spend", "2.5"
    )
    tenant = json.loads(out)
    assert status == 0 and (tenant["rpm"], tenant["daily_spend"]) == (5, 2.5)
    status, out, _ = run(
        capsys, *base, "tenants", "update", tenant["id"], "--rpm", "none", "--monthly-spend", "9"
    )
    tenant = json.loads(out)
    assert status == 0 and (tenant["rpm"], tenant["daily_spend"], tenant["monthly_spend"]) == (
        None,
        2.5,
        9.0,
    )
    status, out, _ = run(capsys, *base, "tenants", "update", tenant["id"], "--daily-spend", "NONE")
    assert json.loads(out)["daily_spend"] is None and json.loads(out)["monthly_spend"] == 9.0

    status, out, _ = run(
        capsys, *base, "keys", "create", tenant["id"], "--tpm", "100", "--models", "a,b"
    )
    key = json.loads(out)
    status, out, _ = run(capsys, *base, "keys", "update", key["id"], "--models", "none")
    assert status == 0 and (json.loads(out)["models"], json.loads(out)["tpm"]) == (None, 100)
    status, out, _ = run(capsys, *base, "keys", "update", key["id"], "--tpm", "none")
    assert status == 0 and json.loads(out)["tpm"] is None
    # lifted in the database: what a gateway reads
    status, out, _ = run(capsys, *base, "keys", "list", "--tenant", tenant["id"])
    assert [(k["tpm"], k["models"]) for k in json.loads(out)] == [(None, None)]

    status, _, err = run(capsys, *base, "keys", "update", key["id"], "--daily-spend", "-1")
    assert status == 1 and "--daily-spend: Input should be greater than or equal to 0" in err
    with pytest.raises(SystemExit) as exit_:
        kvgate([*base, "tenants", "update", tenant["id"], "--rpm", "lots"])
    assert exit_.value.code == 2 and "invalid int value: 'lots'" in capsys.readouterr().err


async def test_prefixes_of_an_unknown_tenant_is_an_error(make_gateway, capsys) -> None:
    gw = await make_gateway()
    tenant, _ = await gw.tenant()
    argv = ["prefixes", "--url", gw.url, "--key", ADMIN_KEY, "--tenant"]
    assert await asyncio.to_thread(kvgate, [*argv, "t_unknown"]) == 1
    out = capsys.readouterr()
    assert out.err.strip() == "kvgate: 404: no tenant 't_unknown'" and out.out == ""
    assert await asyncio.to_thread(kvgate, [*argv, tenant["id"]]) == 0
    assert "per tenant" in capsys.readouterr().out


def _settings_for(*argv: str):
    args = build_parser().parse_args(list(argv))
    return load_settings(None, worker_cli.engine_overrides(args), environ={})


def test_engine_flags_reach_the_backend_options(db_url, capsys) -> None:
    (spec,) = _settings_for(
        "serve", "--backend", "local", "--n-parallel", "2", "--n-ctx", "2048", "--n-threads", "1"
    ).resolved_backends()
    assert spec.type == "local" and spec.options == {"n_parallel": 2, "n_ctx": 2048, "n_threads": 1}
    (spec,) = _settings_for(
        "worker",
        "--backend",
        "gpu",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--gpu-memory-utilization",
        "0.5",
    ).resolved_backends()
    assert spec.options == {"max_model_len": 512, "max_num_seqs": 8, "gpu_memory_utilization": 0.5}
    # from the environment too, as every setting
    env = {"KVGATE_BACKEND": "local", "KVGATE_N_PARALLEL": "3"}
    assert load_settings(None, environ=env).resolved_backends()[0].options == {"n_parallel": 3}
    # a flag of the other backend: a configuration error (exit 2), said in one line
    for argv, message in (
        (["--backend", "gpu", "--n-parallel", "2"], "['n_parallel'] need the local backend"),
        (["--backend", "local", "--max-num-seqs", "2"], "['max_num_seqs'] need the gpu backend"),
        (["--backend", "fake", "--n-ctx", "64"], "['n_ctx'] need the local backend, not 'fake'"),
    ):
        status, _, err = run(capsys, "serve", *argv, "--database-url", db_url)
        assert status == 2 and message in err, argv


@pytest.mark.slow
async def test_local_engine_flags_size_the_llama_cpp_context() -> None:
    (spec,) = _settings_for(
        "serve", "--backend", "local", "--n-parallel", "2", "--n-ctx", "2048", "--n-threads", "1"
    ).resolved_backends()
    backend = build_backend(spec)
    await backend.start()
    try:
        config = backend.engine.config
        assert config.n_parallel == 2 + SPARE_SEATS and config.n_ctx_per_seq == 1024
        assert config.n_threads == 1 and backend.max_in_flight == 2
    finally:
        await backend.stop(drain=False)


def test_help_shows_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        kvgate(["serve", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    for expected in (
        "--host ADDR address to listen on; 0.0.0.0: all (default 127.0.0.1",
        "--port N port to listen on (default 8000",
        "--n-parallel N sequences decoded together (default 4)",
        "(default 16384)",
        "--max-num-seqs N sequences scheduled together (default 256)",
        "(default 0.9)",
        "--config FILE",
    ):
        assert expected in text, expected
    with pytest.raises(SystemExit):
        kvgate(["bench", "serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--num-prompts NUM_PROMPTS (default: 100)" in text
    assert "--endpoint {completions,chat} (default: completions)" in text
    assert "(default: None)" not in text


def test_help_defaults_are_the_engines() -> None:
    from backend_gpu.config import EngineConfig as GpuConfig
    from backend_local.config import EngineConfig as LocalConfig

    local = {f.name: f.default for f in dataclasses.fields(LocalConfig)}
    gpu = {f.name: f.default for f in dataclasses.fields(GpuConfig)}
    assert {k: local[k] for k in worker_cli.LOCAL_DEFAULTS} == worker_cli.LOCAL_DEFAULTS
    assert {k: gpu[k] for k in worker_cli.GPU_DEFAULTS} == worker_cli.GPU_DEFAULTS
