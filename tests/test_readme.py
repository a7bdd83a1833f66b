"""The README, run as written: every shell and Python example, in order, against a gateway
started as `make serve` starts it (its own port and directory, so a fresh database), with
the admin key it prints. A README that stops working fails here.

Also what a new user sees first: the admin key, not other libraries' logs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.backends.default_model import DEFAULT_MODEL_ID
from tests.conftest import free_port
from tests.readme_examples import README, Session, readme_blocks


@dataclass
class Served:
    """`.venv/bin/kvgate serve --port N` in a directory of its own."""

    cwd: Path
    port: int
    proc: subprocess.Popen
    start_up: str  # its output until it listened
    admin_key: str
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def user_env() -> dict[str, str]:
    """The environment of a user who has set nothing of kvgate's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}


def start_as_make_serve(cwd: Path, *flags: str, timeout: float = 240) -> Served:
    # the README's commands say .venv/bin/kvgate, run from the checkout: here the
    # directory holds a .venv/bin that is this interpreter's
    (cwd / ".venv").mkdir()
    (cwd / ".venv" / "bin").symlink_to(Path(sys.executable).parent)
    port = free_port()
    log = cwd / "serve.log"
    env = user_env()
    proc = subprocess.Popen(
        [".venv/bin/kvgate", "serve", "--port", str(port), *flags],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout
    while "kvgate: listening on" not in (text := log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"kvgate serve did not start:\n{text}")
        time.sleep(0.2)
    key = re.search(r"^    export ADMIN=(\S+)$", text, re.MULTILINE)
    return Served(cwd, port, proc, text, key[1] if key else "", env)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    from gateway.backends.default_model import default_model_path

    default_model_path()  # assembled once, before the clock of the start-up starts
    gw = start_as_make_serve(tmp_path_factory.mktemp("readme"))
    yield gw
    gw.proc.terminate()
    try:
        gw.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        gw.proc.kill()


@pytest.mark.slow
def test_start_up_shows_the_admin_key_and_no_other_librarys_log(served: Served) -> None:
    lines = [s for s in served.start_up.splitlines() if s.strip()]
    # only kvgate's own lines, the key on one of its own: no Alembic INFO lines, no
    # llama.cpp load messages ("control-looking token", the SWA cache)
    assert all(s.startswith(("kvgate: ", "    export ")) for s in lines), lines
    assert re.fullmatch(r"kvg-[\w-]{40,}", served.admin_key), served.admin_key
    assert len(lines) <= 8, lines
    text = served.start_up.lower()
    assert "alembic" not in text and "control-looking" not in text and "swa" not in text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_readme_example_runs_in_order(served: Served) -> None:
    env = served.env | {"ADMIN": served.admin_key, "KVGATE_URL": served.url}
    session = Session(served.cwd, env, f"127.0.0.1:{served.port}")
    outputs = []
    for block in readme_blocks():
        if block.skip:
            continue
        if "kvgate prefixes" in block.code:  # the engines' KV events reach the catalog
            _wait_for_cached_prefixes(served)
        outputs.append((block, session.run(block)))
    ran = "\n".join(out for _, out in outputs)
    # what the README promises along the way
    assert session.variables["TENANT"].startswith("t_")
    assert session.variables["KEY"].startswith("kvg-")
    assert "limits: rpm 60, daily_tokens 200000" in ran  # keys create says what it set
    report = next(out for b, out in outputs if "kvgate prefixes" in b.code)
    hot = _section(report, "hottest")
    assert "acme" in hot and session.variables["TENANT"] not in hot, hot  # names, not ids
    pinned = _section(report, "pinned")  # the README's pin spans whole blocks: a replica
    assert re.search(r"support\s+acme\s+gemma-3-270m\s+\d+\s+[a-z]", pinned), pinned


def _wait_for_cached_prefixes(served: Served, timeout: float = 60) -> None:
    headers = {"Authorization": f"Bearer {served.admin_key}"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = httpx.get(served.url + "/admin/prefixes", headers=headers).json()
        if report["prefixes"]:
            return
        time.sleep(0.2)
    raise AssertionError(f"no cached prefix in the report after {timeout:g} s: {report}")


def _section(output: str, title: str) -> str:
    """One table of `kvgate prefixes`' output: from its title to the next blank line."""
    start = output.index(title)
    end = output.find("\n\n", start)
    return output[start : end if end >= 0 else None]


def test_the_readme_marks_what_does_not_run_and_runs_the_rest() -> None:
    blocks = readme_blocks()
    run = [b for b in blocks if not b.skip]
    assert len(run) >= 12, [b.label() for b in run]
    # the walk-through itself runs: a tenant and key, the model by curl, Python and the
    # command line, the pins and the prefix report
    for needed in ("export KEY=", "/v1/completions", "client.completions", "kvgate keys create"):
        assert any(needed in b.code for b in run), needed
    assert any("kvgate prefixes" in b.code for b in run)
    for b in run:
        code = "\n".join(line.split("#")[0] for line in b.code.splitlines())  # not comments
        # placeholders a user would have to edit do not paste
        assert not re.search(r"\b(t_\w*|key_|pfx_)\.\.\.", code), b.label()
        # every command is the checkout's, as `make serve` installs it
        assert not re.search(r"(^|[\s;|&(])kvgate\s", code, re.MULTILINE), b.label()


def test_the_readme_names_only_the_model_make_serve_serves() -> None:
    """Where another model is needed, its block is skipped and the text says how to get
    and allow it; every example that runs asks for the default model."""
    for b in readme_blocks():
        if b.skip:
            continue
        named = re.findall(r"""(?:"model": |model=|MODEL = )"([^"]+)\"""", b.code)
        assert set(named) <= {DEFAULT_MODEL_ID}, (b.label(), named)
    text = README.read_text()
    assert "tenants update acme --models" in text  # how to allow another model


def test_readme_replicas_say_what_workers_run() -> None:
    section = README.read_text().split("### Replicas and cache-aware routing")[1]
    section = section.split("\n## ")[0]
    assert "thread" not in section and "next step" not in section
    assert "`<name>@127.0.0.1:<port>`" in section and "--workers N" in section
