"""What a `kvgate` process imports to start: the suite starts hundreds of them (`kvgate
serve`, admin commands), and users wait on each. A start on a database already at the
newest migration imports no Alembic (with Mako and Pygments, about 0.2 CPU-s), and one of
fake backends no Jinja (only chat templates need it); an admin command that reads the
database imports neither aiohttp nor pydantic; the commands that open no database (`top`,
`bench`, `chat`, `tune`, `plan`) import no SQLAlchemy; none imports torch or
transformers, not even to learn that a CPU build of torch has no CUDA. The checks read
the modules a process imported (`-X importtime`), so they fail the day someone imports
one of them at the top of a module every command loads."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from gateway.db.engine import MIGRATIONS_DIR
from gateway.db.schema import head_revision
from gateway.db.schema_upgrade import alembic_config
from tests.conftest import start_gateway
from tests.gateway.test_worker import start_worker

ENGINE_LIBRARIES = {"torch", "transformers", "llama_cpp", "triton"}
MIGRATION_LIBRARIES = {"alembic", "mako", "pygments"}


def imported(output: str) -> set[str]:
    """The top-level packages that `-X importtime` listed in a process's output."""
    found = re.findall(r"^import time:.*\| *([\w.]+)$", output, flags=re.MULTILINE)
    return {name.split(".")[0] for name in found}


def kvgate(db: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVGATE_DATABASE_URL=f"sqlite+aiosqlite:///{db}")
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gateway.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_each_migration_is_named_after_its_revision_on_one_line_of_history() -> None:
    """head_revision reads the newest migration from the files' names, without Alembic:
    it must be the head Alembic finds."""
    script = ScriptDirectory.from_config(alembic_config(""))
    names = sorted(p.name for p in (MIGRATIONS_DIR / "versions").glob("*.py"))
    revisions = [script.get_revision(name.split("_", 1)[0]) for name in names]
    assert [r.down_revision for r in revisions] == [None] + [r.revision for r in revisions[:-1]]
    assert head_revision() == script.get_current_head() == revisions[-1].revision


def test_an_admin_command_reads_the_database_without_alembic_aiohttp_or_pydantic(
    tmp_path: Path,
) -> None:
    db = tmp_path / "kvgate.db"
    first = kvgate(db, "tenants", "list")  # a new database: migrated, with Alembic
    assert first.returncode == 0, first.stderr
    assert imported(first.stderr) >= MIGRATION_LIBRARIES
    again = kvgate(db, "tenants", "list")
    assert again.returncode == 0, again.stderr
    modules = imported(again.stderr)
    assert "sqlalchemy" in modules  # (the check sees what the command does import)
    assert not modules & (MIGRATION_LIBRARIES | ENGINE_LIBRARIES | {"aiohttp", "pydantic"})


def test_a_gateway_on_a_database_at_head_starts_without_alembic_an_engine_or_jinja(
    tmp_path: Path,
) -> None:
    db = tmp_path / "kvgate.db"
    assert kvgate(db, "db", "upgrade").returncode == 0
    gw = start_gateway(
        tmp_path,
        "--backend",
        "fake",
        database_url=f"sqlite+aiosqlite:///{db}",
        extra_env={"PYTHONPROFILEIMPORTTIME": "1"},
    )
    gw.stop()
    modules = imported(gw.log.read_text())
    assert "aiohttp" in modules
    assert not modules & (MIGRATION_LIBRARIES | ENGINE_LIBRARIES | {"jinja2"})


def test_auto_on_a_cpu_build_of_torch_picks_without_importing_torch() -> None:
    """`--backend auto` asks torch for CUDA; a CPU wheel of torch says in its version that
    it has none, so the pick does without a 2-s import of torch."""
    if not importlib.metadata.version("torch").endswith("+cpu"):
        pytest.skip("torch here is not a CPU build: auto must ask it")
    code = (
        "import sys; from gateway.config_backends import pick_backend_type; "
        "print(pick_backend_type(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["local", "False"]


def test_the_commands_that_open_no_database_import_no_sqlalchemy() -> None:
    """Every `kvgate` command builds the admin commands' parsers and reads gateway.config:
    neither may bring the database layer (about 0.4 CPU-s) to `top`, `bench`, `chat` or
    `tune`, which talk HTTP, or to `plan`."""
    code = (
        "import sys, bench.cli, bench.tune, gateway.cli.chat, tui.cli; "
        "from gateway.cli import build_parser; build_parser(); "
        "print(sorted(sys.modules.keys() & {'sqlalchemy', 'gateway.db'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]"]


def test_a_worker_imports_no_database(tmp_path, monkeypatch) -> None:
    """`kvgate worker` opens no database: SQLAlchemy and asyncpg (about 0.3 CPU-s) came in
    through the gateway's shared middleware and serving modules; the suite starts dozens."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    w = start_worker(tmp_path, "--backend", "fake")
    w.stop()
    modules = imported(w.log.read_text())
    assert "aiohttp" in modules  # (the check sees what the worker does import)
    assert not modules & {"sqlalchemy", "asyncpg", "alembic"}
