"""The SQLite write-ahead log's size under sustained load at the gateway's full rate.

    python -m studies.sqlite_wal [--duration 300] [--wal-limit-bytes N] [--name sqlite_wal]

Starts `kvgate serve --backend fake` on a fresh SQLite database in a temporary
directory (as studies.gateway_overhead does: the server pinned to CPU 0, wrk to CPU 1),
drives it with wrk's closed loop (64 connections) for `--duration` seconds and reads the
size of `bench.db-wal` ten times a second. A log that never starts again grows for as
long as the load lasts; `--wal-limit-bytes` sets the size past which the gateway
starts it again (KVGATE_SQLITE_WAL_LIMIT_BYTES), so 1e12 (1 TB) shows it never
starting again, and what a request costs in it.
Writes `<name>.json` and `<name>.png` (with `--compare`, another run's JSON drawn
beside it) to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gateway.config import SQLITE_WAL_LIMIT_BYTES
from studies.gateway_load import start_kvgate
from studies.gateway_overhead import wrk_throughput
from studies.harness import free_port

SAMPLE_S = 0.1
MB = 1e6
NO_LIMIT = 10**12  # a limit no run reaches


@dataclass
class WalRun:
    duration_s: int
    wal_limit_bytes: int
    rps: float = 0.0
    requests: int = 0  # usage rows committed
    max_wal_bytes: int = 0
    last_wal_bytes: int = 0
    restarts_seen: int = 0  # the file cut back to the limit
    per_second_max: list[int] = field(default_factory=list)  # the largest sample each second

    @property
    def bytes_per_request(self) -> float | None:
        """What a request costs in the log, where the log never started again."""
        if self.restarts_seen or not self.requests:
            return None
        return self.last_wal_bytes / self.requests


class WalSampler(threading.Thread):
    """Reads the log's size every SAMPLE_S seconds until stopped."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.done.is_set():
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            self.samples.append((time.monotonic() - start, size))
            self.done.wait(SAMPLE_S)


def summarize(run: WalRun, samples: list[tuple[float, int]]) -> None:
    sizes = [s for _, s in samples]
    run.max_wal_bytes = max(sizes, default=0)
    run.last_wal_bytes = sizes[-1] if sizes else 0
    run.restarts_seen = sum(1 for a, b in zip(sizes, sizes[1:], strict=False) if b < a)
    seconds = int(samples[-1][0]) + 1 if samples else 0
    run.per_second_max = [0] * seconds
    for t, s in samples:
        run.per_second_max[int(t)] = max(run.per_second_max[int(t)], s)


def measure(args: argparse.Namespace) -> WalRun:
    os.environ["KVGATE_SQLITE_WAL_LIMIT_BYTES"] = str(args.wal_limit_bytes)
    run = WalRun(args.duration, args.wal_limit_bytes)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        port = free_port()
        gw, key = start_kvgate(port, tmp)
        try:
            sampler = WalSampler(tmp / "bench.db-wal")
            sampler.start()
            try:
                run.rps = wrk_throughput(f"http://127.0.0.1:{port}", key, args.duration, tmp)
            finally:
                sampler.done.set()
                sampler.join()
            with contextlib.closing(sqlite3.connect(tmp / "bench.db")) as conn:
                run.requests = conn.execute("SELECT count(*) FROM usage_records").fetchone()[0]
        finally:
            gw.terminate()
            gw.wait()
    summarize(run, sampler.samples)
    return run


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, top in zip(axes, (None, 70), strict=True):
        for name, run in runs.items():
            ax.plot([m / MB for m in run["per_second_max"]], label=name)
        ax.axhline(64, color="red", linestyle="--", label="goal: under 64 MB")
        ax.set_xlabel("seconds of load (wrk, 64 connections, closed loop)")
        ax.set_ylabel("bench.db-wal, MB (largest sample each second)")
        if top is not None:
            ax.set_ylim(0, top)
            ax.set_title("the same, up to 70 MB")
    axes[0].set_title("SQLite WAL size, kvgate serve --backend fake at full rate")
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def label(run: dict) -> str:
    size = run["wal_limit_bytes"]
    limit = "no limit" if size >= NO_LIMIT else f"limit {size / 2**20:,.0f} MiB"
    return f"{limit}: {run['rps']:,.0f} req/s, max {run['max_wal_bytes'] / MB:,.1f} MB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=int, default=300)
    p.add_argument(
        "--wal-limit-bytes",
        type=lambda v: int(float(v)),  # 1e12 reads as bytes too
        default=SQLITE_WAL_LIMIT_BYTES,
        help="the gateway's WAL limit (default: the gateway's)",
    )
    p.add_argument("--name", default="sqlite_wal", help="the output files' name")
    p.add_argument("--compare", help="another run's JSON, drawn beside this one")
    p.add_argument("--out", default="docs/perf")
    args = p.parse_args(argv)
    if not shutil.which("wrk"):
        p.error("wrk is not installed")
    run = measure(args)
    result = asdict(run) | {"bytes_per_request": run.bytes_per_request}
    summary = {k: v for k, v in result.items() if k != "per_second_max"}
    print(json.dumps(summary, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    runs = {label(result): result}
    if args.compare:
        other = json.loads(Path(args.compare).read_text())
        runs[label(other)] = other
    plot(runs, out / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
