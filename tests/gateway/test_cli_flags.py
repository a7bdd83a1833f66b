"""The `kvgate` command's flags and tables, run as a user runs it (a real process):
a flag is taken only spelled in full, a mistyped one is refused by its subcommand with
that subcommand's usage and the flag it most likely meant, and a table fits the
terminal it is printed to."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.cli import build_parser as bench_parser
from bench.tune import build_parser as tune_parser
from gateway.cli import build_parser
from gateway.cli.chat import build_parser as chat_parser
from gateway.cli.output import format_table

LONG_NAME = "acme-corporation-research-and-development-division-east"


def kvgate(*argv: str, db: Path | None = None) -> subprocess.CompletedProcess:
    """`kvgate ARGV` in a process of its own, its output a pipe."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    if db is not None:
        env["KVGATE_DATABASE_URL"] = f"sqlite+aiosqlite:///{db}"
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def on_terminal(*argv: str, columns: int, db: Path) -> list[str]:
    """The lines `kvgate ARGV` prints on a pseudo-terminal `columns` wide."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env.pop("COLUMNS", None)  # the terminal's own size, as a shell's
    env["KVGATE_DATABASE_URL"] = f"sqlite+aiosqlite:///{db}"
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", *argv], env=env, stdout=slave, stderr=slave
    )
    os.close(slave)
    out = b""
    try:
        while chunk := os.read(master, 65536):
            out += chunk
    except OSError:  # EIO: the process closed the terminal
        pass
    finally:
        os.close(master)
    assert proc.wait(timeout=120) == 0, out.decode()
    return out.decode().replace("\r\n", "\n").splitlines()


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """A parser and every subcommand's under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from parsers(child)


def test_no_parser_takes_an_abbreviation() -> None:
    trees = [build_parser(), bench_parser(), tune_parser(), chat_parser()]
    found = [p for tree in trees for p in parsers(tree)]
    assert len(found) > 30  # the walk reached the subcommands
    assert [p.prog for p in found if p.allow_abbrev] == []


def test_an_abbreviated_flag_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    db = tmp_path / "kvgate.db"
    created = kvgate("tenants", "create", "acme", "--json", db=db)
    assert created.returncode == 0, created.stderr
    out = kvgate("tenants", "update", "acme", "--daily-token", "5", db=db)
    assert out.returncode == 2
    assert out.stderr.startswith("usage: kvgate tenants update ")
    assert "unrecognized arguments: --daily-token 5 (did you mean --daily-tokens?)" in out.stderr
    listed = kvgate("tenants", "list", "--json", db=db)
    assert [t["daily_tokens"] for t in json.loads(listed.stdout)] == [None]


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (["serve", "--prot", "8000"], "usage: kvgate serve ", "(did you mean --port?)"),
        (
            ["keys", "create", "acme", "--expires", "60"],
            "usage: kvgate keys create ",
            "--expires-in",
        ),
        (["bench", "serve", "--num-prompt", "5"], "usage: kvgate bench serve ", "--num-prompts"),
        (["plan", "config.json", "--gpu-mem", "80GiB"], "usage: kvgate plan ", "--gpu-memory"),
        (["chat", "--max-token", "5"], "usage: kvgate chat ", "--max-tokens"),
        (["top", "--spee", "2"], "usage: kvgate top ", ""),  # the dashboard's own parser
    ],
)
def test_a_mistyped_flag_gets_its_subcommands_usage_and_a_guess(
    argv: list[str], usage: str, hint: str
) -> None:
    out = kvgate(*argv)
    assert out.returncode == 2
    assert out.stderr.startswith(usage), out.stderr
    assert f"unrecognized arguments: {' '.join(argv[-2:])}" in out.stderr
    assert hint in out.stderr
    assert "{serve,worker" not in out.stderr  # not the top-level usage


def test_tables_fit_the_terminal(tmp_path: Path) -> None:
    db = tmp_path / "kvgate.db"
    created = kvgate("tenants", "create", LONG_NAME, "--rpm", "5", "--json", db=db)
    tenant_id = json.loads(created.stdout)["id"]
    kvgate("keys", "create", tenant_id, "--name", "ci", "--json", db=db)

    # a pipe keeps whole rows, for scripts: the row of limits is wider than 80
    piped = kvgate("tenants", "list", db=db).stdout.splitlines()
    assert max(map(len, piped)) > 120 and LONG_NAME in piped[1]

    for argv in (["tenants", "list"], ["keys", "list", tenant_id], ["models"]):
        for columns in (60, 80, 100):
            lines = on_terminal(*argv, columns=columns, db=db)
            assert lines and max(map(len, lines)) <= columns, (argv, columns, lines)
    # ids stay whole; a tenant's many limits print as a record, one field a line
    record = on_terminal("tenants", "list", columns=80, db=db)
    assert record[0].split() == ["id", tenant_id]
    assert record[1].split() == ["name", LONG_NAME] and record[3].split() == ["rpm", "5"]
    wide = on_terminal("tenants", "list", columns=250, db=db)  # room for the whole row
    assert len(wide) == 2 and LONG_NAME in wide[1] and "…" not in wide[1]


def test_the_widest_column_is_cut_with_an_ellipsis() -> None:
    path = "/home/someone/.cache/models/a-rather-long-directory/gemma-3-270m-q4_k_m.gguf"
    rows = [["gemma-3-270m", path, "253113024"], ["tiny", "/m/tiny.gguf", "1"]]
    lines = format_table(["id", "path", "size"], rows, 60)
    assert max(map(len, lines)) <= 60
    cut = lines[1].split()[1]
    assert "…" in cut and cut.endswith("q4_k_m.gguf") and cut.startswith("/home/")
    assert lines[1].split()[0::2] == ["gemma-3-270m", "253113024"]  # the others whole
    assert lines[2].split() == ["tiny", "/m/tiny.gguf", "1"]
    assert format_table(["id", "path", "size"], rows, None)[1].split()[1] == path
