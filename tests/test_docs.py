"""The README and the docs site, run as written: every shell and Python example, page
after page in order, against one gateway started as `make serve` starts it (its own port
and directory, so a fresh database), with the keys it prints. A page that stops working
fails here.

Also what a new user sees first: the two keys and the models, not other libraries' logs;
and that the first chat answers sensibly."""

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

from gateway.backends.default_model import DEFAULT_MODEL_ID, EMBEDDING_MODEL_ID, INSTRUCT_MODEL_ID
from tests.conftest import free_port
from tests.doc_examples import DOCS, README, ROOT, Session, all_blocks, page_blocks

SERVED = {INSTRUCT_MODEL_ID, DEFAULT_MODEL_ID, EMBEDDING_MODEL_ID}


@dataclass
class Served:
    """`.venv/bin/kvgate serve --port N` in a directory of its own."""

    cwd: Path
    port: int
    proc: subprocess.Popen
    start_up: str  # its output until it listened
    admin_key: str
    key: str  # the starter tenant's
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def user_env() -> dict[str, str]:
    """The environment of a user who has set nothing of kvgate's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}


def _printed(text: str, name: str) -> str:
    found = re.search(rf"^    export {name}=(\S+)$", text, re.MULTILINE)
    return found[1] if found else ""


def start_as_make_serve(cwd: Path, timeout: float = 300) -> Served:
    # the pages' commands say .venv/bin/kvgate, run from the checkout: here the
    # directory holds a .venv/bin that is this interpreter's
    (cwd / ".venv").mkdir()
    (cwd / ".venv" / "bin").symlink_to(Path(sys.executable).parent)
    port = free_port()
    log = cwd / "serve.log"
    env = user_env()
    # on one core, as `taskset -c N make serve` runs it: its llama.cpp engines then take
    # one thread each (backend_local.config.default_threads), where two a core spin at
    # llama.cpp's barriers while the suite's other workers hold the second core. A
    # KVGATE_N_THREADS would make the start no longer bare (the starter set). The child
    # inherits this thread's affinity (no preexec_fn: unsafe beside threads)
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        proc = subprocess.Popen(
            [".venv/bin/kvgate", "serve", "--port", str(port)],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
    finally:
        os.sched_setaffinity(0, cores)
    deadline = time.monotonic() + timeout
    while "kvgate: listening on" not in (text := log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"kvgate serve did not start:\n{text}")
        time.sleep(0.2)
    return Served(cwd, port, proc, text, _printed(text, "ADMIN"), _printed(text, "KEY"), env)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    from gateway.backends.default_model import default_model_path

    default_model_path()  # assembled once, before the clock of the start-up starts
    gw = start_as_make_serve(tmp_path_factory.mktemp("docs"))
    yield gw
    gw.proc.terminate()
    try:
        gw.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        gw.proc.kill()


@pytest.mark.slow
def test_start_up_shows_the_keys_and_the_models_and_no_other_librarys_log(
    served: Served,
) -> None:
    lines = [s for s in served.start_up.splitlines() if s.strip()]
    # only kvgate's own lines and the keys to paste: no Alembic INFO lines, no llama.cpp
    # load messages ("control-looking token", the SWA cache)
    assert all(s.startswith(("kvgate: ", "    export ")) for s in lines), lines
    for key in (served.admin_key, served.key):
        assert re.fullmatch(r"kvg-[\w-]{40,}", key), served.start_up
    assert len(lines) <= 8, lines
    text = served.start_up.lower()
    assert "alembic" not in text and "control-looking" not in text and "swa" not in text
    assert all(model in served.start_up for model in SERVED), served.start_up


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_docs_example_runs_in_order(served: Served) -> None:
    # the reader pasted the two `export` lines the first start printed
    env = served.env | {"ADMIN": served.admin_key, "KEY": served.key, "KVGATE_URL": served.url}
    session = Session(served.cwd, env, f"127.0.0.1:{served.port}")
    session.variables |= {"ADMIN": served.admin_key, "KEY": served.key}
    outputs = []
    for block in all_blocks():
        if block.skip:
            continue
        if "kvgate prefixes" in block.code:  # the engines' KV events reach the catalog
            _wait_for_cached_prefixes(served)
        outputs.append((block, session.run(block)))
    # the README's first chat, by curl and by Python, answers sensibly: the instruct model
    first = [out for b, out in outputs if b.source == README]
    assert len(first) == 2 and all("red" in out.lower() for out in first), first
    ran = "\n".join(out for _, out in outputs)
    # what the pages promise along the way
    assert session.variables["TENANT"].startswith("t_")
    assert session.variables["ACME_KEY"].startswith("kvg-")
    assert "limits: rpm 60, daily_tokens 200000" in ran  # keys create says what it set
    report = next(out for b, out in outputs if "kvgate prefixes" in b.code)
    hot = _section(report, "hottest")
    assert "acme" in hot and session.variables["TENANT"] not in hot, hot  # names, not ids
    pinned = _section(report, "pinned")  # the pin spans whole blocks: a replica holds it
    assert re.search(rf"support\s+acme\s+{DEFAULT_MODEL_ID}\s+\d+\s+[a-z]", pinned), pinned


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


def test_the_docs_mark_what_does_not_run_and_run_the_rest() -> None:
    blocks = all_blocks()
    run = [b for b in blocks if not b.skip]
    assert len(run) >= 25, [b.label() for b in run]
    # the walk-through itself runs: the first chat, a tenant and key, each API, the
    # command line, the pins and the prefix report
    for needed in (
        "/v1/chat/completions",
        "client.chat.completions",
        "client.completions",
        "client.embeddings",
        "claude.messages",
        "client.responses",
        "export ACME_KEY=",
        "kvgate keys create",
        "kvgate prefixes",
    ):
        assert any(needed in b.code for b in run), needed
    for b in run:
        code = "\n".join(line.split("#")[0] for line in b.code.splitlines())  # not comments
        # placeholders a user would have to edit do not paste
        assert not re.search(r"\b(t_\w*|key_|pfx_|kvg-)\.\.\.", code), b.label()
        # every command is the checkout's, as `make serve` installs it
        assert not re.search(r"(^|[\s;|&(])kvgate\s", code, re.MULTILINE), b.label()
    # one marker for all: a page moved from the README keeps no marker of its old test
    for page in [README, *DOCS.rglob("*.md")]:
        assert "readme-test" not in page.read_text(), page


def test_the_docs_name_only_the_models_make_serve_serves() -> None:
    """Where another model is needed, its block is skipped and the text says how to get
    and allow it; every example that runs asks for a model `make serve` serves."""
    for b in all_blocks():
        if b.skip:
            continue
        named = re.findall(r"""(?:"model": |model=|MODEL = )"([^"]+)\"""", b.code)
        assert set(named) <= SERVED, (b.label(), named)
    assert "tenants update acme --models" in (DOCS / "getting-started.md").read_text()


def test_the_readme_is_a_front_page_whose_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    # the first chat comes early: before any reference
    assert text.index("## The first chat") < text.index("## Where next")
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert links and all((ROOT / link).exists() for link in links), links
    assert len(page_blocks(README)) >= 3


def test_replicas_say_what_workers_run() -> None:
    section = (DOCS / "prefix-caching.md").read_text().split("## Replicas and cache-aware")[1]
    section = section.split("\n## ")[0]
    assert "thread" not in section and "next step" not in section
    assert "`<name>@127.0.0.1:<port>`" in section and "--workers N" in section
