"""The KV tiers' secret (issue 45), the key of the MAC on every KV block the engines
store or move: every gateway on one database gets the same one, generated once into
it (or the one configured), and gives it to its engines, in-process as an engine
option and to a `kvgate worker` in its environment, never on a command line nor in a
log; a gateway with another secret takes nothing its blocks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.backends import BackendSpec
from gateway.config import Settings
from gateway.config_load import load_settings
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.conftest import PG_URL
from tests.gateway.test_prefixes import cached, eventually

ROOT = Path(__file__).resolve().parents[2]
CONFIGURED = "a secret of the operator's choosing, 40 chars"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("secret-model")))


@pytest.mark.slow
async def test_two_gateways_on_one_database_share_the_secret_and_their_blocks(
    pg_schema, make_gateway, tiny_llama, tmp_path, caplog
) -> None:
    db = {"database_url": PG_URL, "database_schema": pg_schema}
    disk = {"seed": 1, "kv_disk_path": str(tmp_path / "kv")}
    backends = [BackendSpec("tiny", "gpu", tiny_llama, "tiny", disk)]
    a = await make_gateway(backends, instance="gw-a", **db)
    _, key = await a.tenant("t")
    assert await cached(a, key, "What is paging?") == 0
    (engine_a,) = a.state.router.backends
    await eventually(lambda: engine_a.stats().extra.get("kv_disk_blocks_written", 0), bool)

    # another gateway on the database, its own engine on the same disk directory
    b = await make_gateway(backends, instance="gw-b", **db)
    secret = a.state.kv_tier_secret
    assert b.state.kv_tier_secret == secret and len(secret) == 64  # generated, 32 bytes
    assert await cached(b, key, "What is paging?") > 0  # a's blocks, checked and taken
    assert b.state.router.backends[0].stats().extra["kv_disk_hits"] > 0

    # one told another secret: a's blocks are not its own (dropped at its start)
    c = await make_gateway(backends, instance="gw-c", kv_tier_secret=CONFIGURED, **db)
    assert c.state.kv_tier_secret == CONFIGURED
    assert await cached(c, key, "What is paging?") == 0
    assert secret not in caplog.text and CONFIGURED not in caplog.text


async def test_another_database_generates_another_secret(make_gateway, tmp_path) -> None:
    a = await make_gateway()
    b = await make_gateway(database_url=f"sqlite+aiosqlite:///{tmp_path / 'other.db'}")
    assert a.state.kv_tier_secret != b.state.kv_tier_secret
    again = await make_gateway()  # the first database again: its secret kept
    assert again.state.kv_tier_secret == a.state.kv_tier_secret


async def test_a_worker_gets_the_secret_in_its_environment_not_its_command_line(
    make_gateway,
) -> None:
    gw = await make_gateway(workers=1)
    (supervisor,) = gw.state.supervisors
    environ, cmdline = proc_files(supervisor.workers[0].proc.pid)
    secret = gw.state.kv_tier_secret
    assert f"KVGATE_KV_TIER_SECRET={secret}".encode() in environ.split(b"\0")
    assert secret.encode() not in cmdline


def proc_files(pid: int) -> tuple[bytes, bytes]:
    """A process's environment and command line, as the kernel holds them."""
    return Path(f"/proc/{pid}/environ").read_bytes(), Path(f"/proc/{pid}/cmdline").read_bytes()


def test_the_secret_is_read_from_the_environment_and_never_shown() -> None:
    settings = load_settings(environ={"KVGATE_KV_TIER_SECRET": CONFIGURED})
    assert settings.kv_tier_secret == CONFIGURED
    assert CONFIGURED not in repr(settings)
    with pytest.raises(ValueError, match="kv_tier_secret must be at least 32") as e:
        load_settings(environ={"KVGATE_KV_TIER_SECRET": "short"})
    assert "short" not in str(e.value)


def test_the_secret_is_no_engine_option() -> None:
    spec = BackendSpec("tiny", "gpu", "m", "", {"kv_tier_secret": CONFIGURED})
    with pytest.raises(ValueError, match="kv_tier_secret is not an engine option") as e:
        Settings(backend="", backends=[spec])
    assert CONFIGURED not in str(e.value)


def worker(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gateway.cli", "worker", "--port", "0", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, error",
    [
        (["--role", "decode"], "--role decode needs kv_tier_secret"),
        (["--options", json.dumps({"kv_tier_secret": CONFIGURED})], "not an engine option"),
    ],
)
def test_a_worker_refuses_a_pair_without_the_secret_or_the_secret_as_a_flag(
    args, error, monkeypatch
) -> None:
    monkeypatch.delenv("KVGATE_KV_TIER_SECRET", raising=False)
    run = worker("--backend", "gpu", "--model", "m", *args)
    assert run.returncode == 2 and error in run.stderr, run.stderr
    assert CONFIGURED not in run.stderr
