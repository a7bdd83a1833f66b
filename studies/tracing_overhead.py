"""What OpenTelemetry tracing costs the gateway: requests/s with traces on (exported to a
local collector stand-in) against off, and off against the commit before tracing came in.

    python -m studies.tracing_overhead [--rounds 3] [--duration 8] [--before REV] [--sampled 0.1]

Four `kvgate serve --backend fake` processes, the gateway alone as
studies/gateway_overhead.py runs it (auth, quota, usage rows on SQLite), each pinned to
CPU 0:
- before: the tree at REV (default: the parent of the commit that added
  gateway/observe/tracing.py), checked out with `git worktree`;
- off: this tree, tracing off (OTEL_SDK_DISABLED=true, whatever the shell sets);
- on: this tree, exporting every request's spans over OTLP/HTTP to
  studies/otlp_collector.py, in a process of its own, which parses every batch;
- sampled: as on, with the standard sampler tracing a share of the requests
  (OTEL_TRACES_SAMPLER=parentbased_traceidratio, --sampled).
They are measured in turns, round after round (before, off, on, sampled, before, ...),
by the same aiohttp closed loop (64 connections, non-streaming chat completions of 16
tokens), so a change in a shared machine's load falls on all of them alike. Each figure
is the median of its rounds; the spread of the rounds says how large the noise is.
Beside requests/s, each server's CPU time per request (from /proc): on a shared machine
the cores go to others by turns, and CPU per request, whose inverse is the requests/s of
a core of its own, moves much less. The process that exports the spans (a child of the
server, pinned to the same core with it) is counted apart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.options import DefaultsHelpFormatter
from studies.gateway_load import cpu_seconds, start_kvgate
from studies.gateway_overhead import closed_loop
from studies.harness import free_port, stop_process

VARIANTS = ("before", "off", "on", "sampled")
COLORS = ("#999999", "#1f77b4", "#ff7f0e", "#2ca02c")
ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def before_tracing() -> str:
    """The commit before the one that added gateway/observe/tracing.py."""
    added = _git("log", "--diff-filter=A", "--format=%H", "--", "gateway/observe/tracing.py")
    return _git("rev-parse", added.split()[-1] + "~1").strip()


def start_collector() -> tuple[subprocess.Popen, str]:
    """studies.otlp_collector in its own process, and the URL it prints."""
    cmd = [sys.executable, "-m", "studies.otlp_collector"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def children_cpu_seconds(pid: int) -> float:
    """The CPU time so far of the process's child processes (its trace exporter)."""
    total = 0.0
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            with contextlib.suppress(OSError):  # it may have just left
                total += cpu_seconds(int(child))
    return total


def spans_received(collector_url: str) -> int:
    return httpx.get(collector_url.removesuffix("/v1/traces") + "/count").json()["spans"]


def run(args: argparse.Namespace, tmp: Path) -> dict:
    tree = tmp / "source-before"
    _git("worktree", "add", "--detach", str(tree), args.before)
    collector, collector_url = start_collector()
    servers: dict[str, tuple[subprocess.Popen, str, str]] = {}
    try:
        on = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector_url}
        off = {"OTEL_SDK_DISABLED": "true"}  # whatever this shell's OTEL_* variables say
        # the standard way to trace a share of the requests: the cost scales with it
        sampled = on | {
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(args.sampled),
        }
        variants = {"before": (off, tree), "off": (off, None), "on": (on, None)}
        variants["sampled"] = (sampled, None)
        for name, (extra, source) in variants.items():
            (tmp / name).mkdir()
            port = free_port()
            proc, key = start_kvgate(port, tmp / name, extra, source)
            servers[name] = (proc, f"http://127.0.0.1:{port}", key)
        rps: dict[str, list[float]] = {name: [] for name in VARIANTS}
        cpu_us: dict[str, list[float]] = {name: [] for name in VARIANTS}
        child_us: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for r in range(args.rounds):
            for name in VARIANTS:
                proc, url, key = servers[name]
                asyncio.run(closed_loop(url, key, 2))  # warm the server and the pool
                cpu, child = cpu_seconds(proc.pid), children_cpu_seconds(proc.pid)
                rps[name].append(asyncio.run(closed_loop(url, key, args.duration)))
                used = cpu_seconds(proc.pid) - cpu
                requests = rps[name][-1] * args.duration
                cpu_us[name].append(1e6 * used / requests)
                child_us[name].append(1e6 * (children_cpu_seconds(proc.pid) - child) / requests)
                line = f"{rps[name][-1]:,.0f} req/s, {cpu_us[name][-1]:,.0f} us of CPU a request"
                line += f" (+{child_us[name][-1]:,.0f} in its exporting process)"
                print(f"round {r + 1}/{args.rounds} {name}: {line}", flush=True)
        spans = spans_received(collector_url)
    finally:
        for proc, _, _ in servers.values():
            stop_process(proc)
        stop_process(collector)
        _git("worktree", "remove", "--force", str(tree))
    median = {name: statistics.median(v) for name, v in rps.items()}
    cpu = {name: statistics.median(v) for name, v in cpu_us.items()}
    return {
        "before": args.before,
        "rounds": rps,
        "median_rps": median,
        "on_vs_off": median["on"] / median["off"],
        "off_vs_before": median["off"] / median["before"],
        "sampled_vs_off": median["sampled"] / median["off"],
        "sampled_ratio": args.sampled,
        # the server's own CPU time per request (its exporting child apart): steadier
        # than requests/s on a shared machine, where the load takes the cores by turns
        "cpu_us_rounds": cpu_us,
        "median_cpu_us": cpu,
        "capacity_on_vs_off": cpu["off"] / cpu["on"],
        # the same ratio round by round (off and on measured seconds apart), its median:
        # a load that drifts over the run falls on both sides of each round's ratio
        "capacity_on_vs_off_paired": statistics.median(
            off / on for off, on in zip(cpu_us["off"], cpu_us["on"], strict=True)
        ),
        # the exporting child's CPU per request (on another core, it takes none of the
        # gateway's; on the same one, as pinned here, its share shows in requests/s)
        "exporter_cpu_us_rounds": child_us,
        "median_exporter_cpu_us": {n: statistics.median(v) for n, v in child_us.items()},
        "capacity_off_vs_before": cpu["before"] / cpu["off"],
        "capacity_sampled_vs_off": cpu["off"] / cpu["sampled"],
        # the noise: how far one variant's rounds lie apart, as a share of their median
        "spread": {n: (max(v) - min(v)) / statistics.median(v) for n, v in rps.items()},
        "spans_received": spans,
        "duration_s": args.duration,
        "loadavg_start": args.loadavg,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    sampled = f"{result['sampled_ratio']:.0%} sampled"
    names = ["before\ntracing", "tracing\noff", "tracing\non", sampled]
    for ax, key, rounds, label in (
        (left, "median_rps", "rounds", "requests/s"),
        (right, "median_cpu_us", "cpu_us_rounds", "CPU us of the gateway a request"),
    ):
        for i, name in enumerate(VARIANTS):
            runs = result[rounds][name]
            ax.bar(i, result[key][name], color=COLORS[i])
            ax.plot([i] * len(runs), runs, "k.", label="a round" if i == 0 else None)
        ax.set_xticks(range(len(VARIANTS)), names)
        ax.set_ylabel(f"{label} (median of rounds)")
        ax.legend()
    left.set_title(f"on/off {result['on_vs_off']:.2f}x, off/before {result['off_vs_before']:.2f}x")
    right.set_title(
        f"capacity on/off {result['capacity_on_vs_off']:.2f}x, "
        f"off/before {result['capacity_off_vs_before']:.2f}x"
    )
    fig.suptitle("The gateway with OpenTelemetry traces (fake backend, OTLP/HTTP)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=int, default=8, help="seconds of load per measurement")
    p.add_argument("--before", help="the commit to compare with (default: before tracing)")
    p.add_argument(
        "--sampled", type=float, default=0.1, help="the share of requests traced in 'sampled'"
    )
    p.add_argument("--out", default="docs/perf")
    args = p.parse_args(argv)
    args.before = args.before or before_tracing()
    args.loadavg = Path("/proc/loadavg").read_text().split()[:3]
    print(f"before = {args.before[:10]}, load {' '.join(args.loadavg)}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        result = run(args, Path(d))
    result["wall_s"] = round(time.monotonic() - started)
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tracing_overhead.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "tracing_overhead.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
