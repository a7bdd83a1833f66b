"""What `python -m studies.hostile_surfaces` runs its cases on: a commit's checkout, the
tiny models built once for both sides, and one side's two gateways started from its
checkout (one on fake backends, one on gpu engines on the CPU), with what a case reads
from outside: usage rows from the gateway's SQLite file, a process's peak memory.

A case judges what a tenant or an admin sees, so both sides run the same requests; the
gateways differ only in the code they run (`cwd`: the checkout's modules come first).
"""

from __future__ import annotations

import contextlib
import json
import resource
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from studies.harness import (
    ADMIN_KEY,
    TINY_LLAMA,
    Process,
    make_tenant,
    start_gateway,
    toml_backend,
)

ROOT = Path(__file__).resolve().parent.parent
FAKE, FAKE_EMBED = "fake-model", "fake-embed"
TINY, EMBED, DISK, SHARED, SILENT = "tiny", "embed", "disk", "shared", "silent"
PRICES = {FAKE: (2.0, 4.0), TINY: (1.0, 2.0), EMBED: (1.0, 0.0), DISK: (1.0, 2.0)}
PRICES |= {SHARED: (1.0, 2.0)}
KV_CACHE_BYTES = 64 << 20  # per engine: five tiny models share a CPU's memory
ENGINE = {"device": "cpu", "kv_cache_memory_bytes": KV_CACHE_BYTES}


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


@contextlib.contextmanager
def worktree(rev: str, where: Path) -> Iterator[Path]:
    """A clean checkout of `rev` at `where` (a `git worktree`), removed afterwards."""
    if where.exists():  # left by a run that was killed
        git("worktree", "remove", "--force", str(where))
    git("worktree", "add", "--detach", str(where), rev)
    try:
        yield where
    finally:
        git("worktree", "remove", "--force", str(where))


@dataclass
class Models:
    """The files the gpu engines serve: built once, by this tree's test helpers."""

    llama: str  # the serving studies' random Llama (51.7M): a prefill takes seconds
    byte_llama: str  # a tiny Llama whose tokens are mostly bytes: 2048 positions
    embedder: str  # a tiny Qwen3 embedding model
    silent: str  # a tiny Llama that often stops at once (issue 45, item 11)
    adapter: str  # a PEFT LoRA adapter of `llama`

    @classmethod
    def build(cls, root: Path) -> Models:
        from bench.tiny_model import build_tiny_llama
        from tests.backend_gpu.byte_tokens import save_byte_token_model
        from tests.backend_gpu.embedding_models import save_tiny_qwen3_embedding
        from tests.backend_gpu.lora_adapters import save_random_adapter
        from tests.bench.silent_model import build_silent_llama

        root.mkdir(parents=True, exist_ok=True)
        llama = root / "llama"
        if not (llama / "config.json").exists():
            build_tiny_llama(llama, **TINY_LLAMA, vocab_size=32_000)
        byte_llama = save_byte_token_model("llama", str(root))
        embedder = root / "embed"
        if not embedder.exists():
            save_tiny_qwen3_embedding(str(embedder))
        silent = root / "silent"
        if not (silent / "config.json").exists():
            build_silent_llama(silent)
        adapter = save_random_adapter(str(llama), str(root / "llama-adapter"), r=4)
        return cls(str(llama), byte_llama, str(embedder), str(silent), adapter)


def prices_toml(models: list[str]) -> str:
    return "".join(
        f'[prices."{m}"]\ninput = {PRICES[m][0]}\noutput = {PRICES[m][1]}\n' for m in models
    )


def fake_config() -> str:
    """The fake backends: a paced generator (a stream lasts long enough to act during
    it) and an embedder; prices, so that a request's spend shows."""
    return (
        toml_backend("fake", "fake", FAKE, tokens_per_second=50)
        + toml_backend("fake-embed", "fake", FAKE_EMBED, task="embed")
        + prices_toml([FAKE])
    )


def engine_config(models: Models, workdir: Path, redis_url: str) -> str:
    """The gpu engines on the CPU: `tiny` prefills in chunks of 8 tokens and takes LoRA
    adapters; `embed` pools two inputs a step; `disk` and `shared` keep their KV blocks
    in a directory and in Redis; `silent` often has nothing to say."""
    return (
        toml_backend(
            TINY,
            "gpu",
            TINY,
            models.llama,
            **ENGINE,
            max_num_batched_tokens=8,
            enable_lora=True,
            max_lora_rank=8,
        )
        + toml_backend(EMBED, "gpu", EMBED, models.embedder, **ENGINE, max_num_seqs=2)
        + toml_backend(
            DISK, "gpu", DISK, models.byte_llama, **ENGINE, kv_disk_path=str(workdir / "kv-disk")
        )
        + toml_backend(SHARED, "gpu", SHARED, models.byte_llama, **ENGINE, kv_shared_url=redis_url)
        + toml_backend(SILENT, "gpu", SILENT, models.silent, **ENGINE, max_model_len=256)
        + prices_toml([TINY, EMBED, DISK, SHARED])
    )


@dataclass
class Outcome:
    """What one case saw on one side: whether the gateway did what issue 45 asks (None:
    that code has nothing to try it on), and the figure that says so."""

    item: int
    case: str
    ok: bool | None
    figure: str


@dataclass
class Gateway:
    """One side's running gateway, started from its checkout: what a case talks to."""

    tree: Path
    workdir: Path
    name: str
    config: str
    proc: Process | None = None
    keys: dict[str, str] = field(default_factory=dict)  # tenant label -> key
    tenant_ids: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def db(self) -> Path:
        return self.workdir / f"{self.name}.db"

    @property
    def config_file(self) -> Path:
        return self.workdir / f"{self.name}.toml"

    @property
    def pid(self) -> int:
        return self.proc.proc.pid

    def start(self, log: str | None = None) -> Gateway:
        """Start it (again: the same database and files, a fresh process)."""
        env = {"KVGATE_DATABASE_URL": f"sqlite+aiosqlite:///{self.db}"}
        self.proc = start_gateway(
            self.workdir, log or self.name, self.config, env=env, cwd=self.tree
        )
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def tenant(self, label: str, **limits: float) -> str:
        """A tenant's key, made on first use."""
        if label not in self.keys:
            self.tenant_ids[label], self.keys[label] = make_tenant(self.url, label, **limits)
        return self.keys[label]

    def post(self, path: str, body: dict, key: str | None = None, timeout: float = 300):
        auth = key or ADMIN_KEY
        return httpx.post(
            self.url + path, json=body, headers={"Authorization": f"Bearer {auth}"}, timeout=timeout
        )

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        auth = {"Authorization": f"Bearer {key or ADMIN_KEY}"}
        return httpx.get(self.url + path, headers=auth, timeout=60)

    def admin_get(self, path: str) -> dict:
        r = self.get(path)
        r.raise_for_status()
        return r.json()

    def backend(self, name: str) -> dict:
        """/admin/backends' row of backend `name`."""
        (row,) = [b for b in self.admin_get("/admin/backends")["data"] if b["name"] == name]
        return row

    def rows(self, label: str) -> list[dict]:
        """The usage rows of tenant `label`, oldest first, read from the database file."""
        with contextlib.closing(sqlite3.connect(self.db)) as db:
            db.row_factory = sqlite3.Row
            found = db.execute(
                "SELECT * FROM usage_records WHERE tenant_id = ? ORDER BY id",
                (self.tenant_ids[label],),
            )
            return [dict(r) for r in found]

    def wait_rows(self, label: str, n: int, timeout: float = 60) -> list[dict]:
        """Tenant `label`'s rows once there are `n` (written after the answer, or after
        the gateway saw its client leave)."""
        deadline = time.monotonic() + timeout
        while len(rows := self.rows(label)) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        return rows

    def log_text(self) -> str:
        return self.proc.log.read_text(errors="replace")


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM) since the last `reset_peak_rss`, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def reset_peak_rss(pid: int) -> float:
    """Start the process's peak resident memory again from what it holds now (Linux's
    clear_refs 5), so that a case's growth is its own; that memory, in MiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return peak_rss_mib(pid)


def cap_address_space(pid: int, headroom_gib: float) -> None:
    """Limit the process's address space to what it maps now plus `headroom_gib`: a
    server that reads a file without bound fails an allocation rather than take the
    machine's memory (its other users' too)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            limit = int(line.split()[1]) * 1024 + int(headroom_gib * (1 << 30))
            resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))
            return


def message_of(response: httpx.Response) -> str:
    """An error answer's message (OpenAI's and Anthropic's shapes), else its text."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(response.json()["error"]["message"])
    return response.text[:300]


def short(value: object, n: int = 90) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= n else text[: n - 1] + "…"
