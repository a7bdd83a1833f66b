"""A history of benchmark runs: every `kvgate bench` run (and every `kvgate tune`
candidate) leaves one JSON record in a results directory, so that the next tuning
starts from numbers rather than memory, and two runs can be compared (compare.py).

A record says when, what code (the git commit, else the package version), the command
and its config, the hardware (CPU model and cores, GPUs and their memory), and the
figures: the median over the run's rounds, each round's values, and their spread
(max - min), which `bench compare` holds a change against. A record holds none of the
keys the run was given (redact.py); the directory is its owner's alone (0700), and so is
each record (0600).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from bench.redact import redact_record
from bench.server_memory import PeakMemory

HISTORY_ENV = "KVGATE_BENCH_HISTORY"
SOURCE_DIR = Path(__file__).resolve().parent.parent


def default_results_dir() -> Path:
    """$KVGATE_BENCH_HISTORY, else bench-history under kvgate's cache directory."""
    if os.environ.get(HISTORY_ENV):
        return Path(os.environ[HISTORY_ENV])
    cache = os.environ.get("KVGATE_CACHE_DIR") or Path.home() / ".cache" / "kvgate"
    return Path(cache) / "bench-history"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[dict]:
    """Name and memory of each GPU nvidia-smi lists; none without one."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [line.rsplit(",", 1) for line in out.splitlines() if "," in line]
    return [{"name": name.strip(), "memory_bytes": int(mib) << 20} for name, mib in rows]


def hardware() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "gpus": gpus()}


def code_version() -> dict:
    """The git commit of this source tree (and whether it has changes), else the
    installed package's version."""
    version: dict = {"package": None, "commit": None, "dirty": None}
    with contextlib.suppress(metadata.PackageNotFoundError):
        version["package"] = metadata.version("kvgate")
    git = ["git", "-C", str(SOURCE_DIR)]
    try:
        commit = subprocess.run(
            [*git, "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if commit.returncode == 0:
            version["commit"] = commit.stdout.strip()
            status = subprocess.run(
                [*git, "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            version["dirty"] = bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return version


def summarize_rounds(rounds: Sequence[dict[str, float]]) -> tuple[dict, dict]:
    """(median, spread = max - min) of each figure over the rounds that have it."""
    names = [n for n in rounds[0] if all(isinstance(r.get(n), int | float) for r in rounds)]
    medians = {n: float(statistics.median(r[n] for r in rounds)) for n in names}
    spread = {n: float(max(r[n] for r in rounds) - min(r[n] for r in rounds)) for n in names}
    return medians, spread


def make_record(
    kind: str,
    command: Sequence[str],
    config: dict,
    rounds: Sequence[dict[str, float]],
    peak_memory: PeakMemory | None,
) -> dict:
    """One run's record; `rounds`: each repeat's figures (at least one), the server's
    peak memory among them; `peak_memory`: the largest, and whose it was."""
    if not rounds:
        raise ValueError("a history record needs the figures of at least one round")
    now = datetime.now(UTC)
    figures, spread = summarize_rounds(rounds)
    record = {
        "id": f"{now:%Y%m%dT%H%M%S}.{now.microsecond // 1000:03d}-{kind}-{uuid.uuid4().hex[:4]}",
        "when": now.isoformat(timespec="milliseconds"),
        "kind": kind,
        "version": code_version(),
        "command": list(command),
        "config": config,
        "hardware": hardware(),
        "figures": figures,
        "spread": spread,
        "rounds": [dict(r) for r in rounds],
        "peak_memory": asdict(peak_memory) if peak_memory else None,
    }
    return redact_record(record)


def save_record(record: dict, results_dir: str | Path | None = None) -> Path:
    """Write the record as <id>.json in the results directory (made if missing), both
    readable by their owner only."""
    directory = Path(results_dir) if results_dir else default_results_dir()
    private_directory(directory)
    path = directory / f"{record['id']}.json"
    tmp = path.with_suffix(".json.partial")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a partial file an earlier run left keeps its mode
        f.write(json.dumps(record, indent=2))
    os.replace(tmp, path)  # a reader never sees half a record
    return path


def private_directory(directory: Path) -> None:
    """Make the directory 0700, or tighten it to that: records say which servers were
    run against, how, and by what command."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if directory.stat().st_mode & 0o077:
        with contextlib.suppress(PermissionError):  # another user's: its records stay 0600
            directory.chmod(0o700)


def load_records(results_dir: str | Path | None = None) -> list[dict]:
    """Every record in the directory, oldest first; unreadable files are skipped."""
    directory = Path(results_dir) if results_dir else default_results_dir()
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "figures" in record and "id" in record:
            records.append(redact_record(record))
    return sorted(records, key=lambda r: (r.get("when", ""), r["id"]))


def find_record(ref: str, results_dir: str | Path | None = None) -> dict:
    """A record by file path, id, unique id prefix, or position (-1: the latest)."""
    if ref.endswith(".json") and os.path.isfile(ref):
        return redact_record(json.loads(Path(ref).read_text()))
    records = load_records(results_dir)
    if ref.lstrip("-").isdigit():
        index = int(ref)
        if -len(records) <= index < len(records):
            return records[index]
        raise ValueError(f"no run {ref}: the history holds {len(records)}")
    matches = [r for r in records if r["id"].startswith(ref)]
    if len(matches) != 1:
        found = "no run" if not matches else f"{len(matches)} runs"
        raise ValueError(f"{found} with id {ref!r} in {results_dir or default_results_dir()}")
    return matches[0]


def flatten_figures(value: object, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a result (a sweep's, a ladder's) as dotted names."""
    out: dict[str, float] = {}
    if isinstance(value, bool):
        return out
    if isinstance(value, int | float):
        return {prefix: float(value)}
    items = value.items() if isinstance(value, dict) else []
    if isinstance(value, list) and len(value) <= 64:
        items = enumerate(value)
    for key, item in items:
        out |= flatten_figures(item, f"{prefix}.{key}" if prefix else str(key))
    return out
