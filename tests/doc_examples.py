"""The examples of the README and of the docs site as code: their ```bash and ```python
blocks, page after page in the site's order (mkdocs.yml's nav), and a runner that pastes
them into a shell and a Python session as a user following them would.

A block that cannot run against the gateway `make serve` starts (one that starts another
server, needs a model file of the user's own, a GPU, Docker, or takes over the terminal)
is marked on the line before its fence: `<!-- docs-test: skip (why) -->`. Every other
block runs.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# records, not walk-throughs: their commands are the studies' (tests/studies run them)
# and the design's sketches
NOT_WALKED = {"design.md", "PERF.md", "STATS.md"}
SKIP = re.compile(r"^\s*<!-- docs-test: skip \((?P<why>[^)]+)\) -->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\w*)\s*$")
# `NAME=$(...)`, `NAME=word` or `export NAME=...` alone on a line: a variable later
# blocks read (`NAME=word command` sets it for that command only)
ASSIGNED = re.compile(
    r"^\s*(?:export\s+)?(?P<name>[A-Z_][A-Z0-9_]*)=(?:\$\(|\S+\s*(?:#.*)?$)", re.MULTILINE
)
DEFAULT_ADDRESS = "127.0.0.1:8000"


@dataclass
class Block:
    lang: str  # bash | python
    code: str
    source: Path  # the page it is on
    line: int  # where its fence opens, for failure messages
    skip: str | None  # why it does not run, or None

    def label(self) -> str:
        return f"{self.source.relative_to(ROOT)}:{self.line} ({self.lang})"


def nav_pages() -> list[Path]:
    """The site's pages in its order (mkdocs.yml's nav)."""

    def walk(items: list) -> list[str]:
        found = []
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            found += walk(value) if isinstance(value, list) else [value]
        return found

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [DOCS / page for page in walk(nav)]


def walked_pages() -> list[Path]:
    """The README, then every page of the site that is walked through in order."""
    return [README, *(p for p in nav_pages() if p.name not in NOT_WALKED)]


def page_blocks(page: Path) -> list[Block]:
    """Every bash and python block of one page, in order."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened or not opened["lang"]:
            i += 1
            continue
        start, indent = i, len(opened["indent"])
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        i += 1
        if opened["lang"] in ("bash", "python"):
            before = next((s for s in reversed(lines[:start]) if s.strip()), "")
            skip = SKIP.match(before)
            code = "\n".join(body) + "\n"
            blocks.append(Block(opened["lang"], code, page, start + 1, skip and skip["why"]))
    return blocks


def all_blocks() -> list[Block]:
    """The blocks of every walked page, in the order a reader meets them."""
    return [b for page in walked_pages() for b in page_blocks(page)]


class Session:
    """A shell and a Python session in `cwd`, as a user pastes the examples into them:
    variables a bash block sets reach later blocks (exported, as Python reads `$KEY`
    from the environment), and Python blocks share one namespace."""

    def __init__(self, cwd: Path, env: dict[str, str], address: str) -> None:
        self.cwd = cwd
        self.env = env
        self.address = address
        self.variables: dict[str, str] = {}
        self.namespace: dict[str, object] = {"__name__": "__docs__"}
        self.state = cwd / "readme-shell-state.sh"
        self.state.write_text("")

    def adapt(self, code: str) -> str:
        """The pages' address, 127.0.0.1:8000, is where this session's gateway is."""
        return code.replace(DEFAULT_ADDRESS, self.address)

    def run(self, block: Block, timeout: float = 300) -> str:
        """Run one block; its output. A failure raises AssertionError naming the block."""
        if block.lang == "bash":
            return self._bash(block, timeout)
        return self._python(block)

    def _bash(self, block: Block, timeout: float) -> str:
        names = sorted(set(ASSIGNED.findall(block.code)))
        keep = "".join(
            f'printf "export {n}=%q\\n" "${{{n}-}}" >> {shlex.quote(str(self.state))}\n'
            for n in names
        )
        script = (
            f"set -euo pipefail\nsource {shlex.quote(str(self.state))}\n"
            + self.adapt(block.code)
            + keep
        )
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{block.label()} exited {done.returncode}:\n{output}"
        # curl -s exits 0 on an HTTP error: an error body is the failure to see
        assert '"error"' not in done.stdout, f"{block.label()} got an error:\n{output}"
        for name in names:
            value = self._read_variable(name)
            assert value not in ("", "null"), f"{block.label()} left ${name} {value!r}:\n{output}"
            self.variables[name] = value
        return output

    def _read_variable(self, name: str) -> str:
        got = subprocess.run(
            ["bash", "-c", f'source {shlex.quote(str(self.state))}; printf %s "${{{name}-}}"'],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        return got.stdout

    def _python(self, block: Block) -> str:
        out = io.StringIO()
        saved = dict(os.environ)
        os.environ.update(self.variables)  # what the shell exported, as in a real session
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(self.adapt(block.code), block.label(), "exec"), self.namespace)
        except Exception as e:
            raise AssertionError(f"{block.label()} raised {e!r}:\n{out.getvalue()}") from e
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return out.getvalue()
