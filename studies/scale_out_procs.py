"""The one measurement studies.scale_out is made of, and what it reads of the processes
(studies.harness starts them): one load sent with `kvgate bench serve`'s client
(bench.serve), so every figure has vLLM's metric definitions, with the CPU time each
watched process spent on it; the options and cores a gateway gave its workers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.datasets import SampleRequest
from bench.serve import ServeConfig, serve_benchmark
from studies.harness import Process


class MeasurementError(RuntimeError):
    """A request of a measured load failed: the figure would be wrong, so there is none."""


@dataclass
class Run:
    """One load against one server: vLLM's definitions (bench/metrics.py), usage counts."""

    label: str
    requests: int
    concurrency: int
    duration_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    tokens_per_s: float  # output tokens / wall duration of the load
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttfts_ms: list[float] = field(default_factory=list)
    # CPU seconds each watched process used during the load ("client": this process)
    cpu_s: dict[str, float] = field(default_factory=dict)


def measure(
    url: str,
    keys: list[str],
    model: str,
    requests: Sequence[SampleRequest],
    concurrency: int,
    label: str,
    watch: dict[str, int] | None = None,
) -> Run:
    """Send `requests` (greedy, streaming, ignore_eos) at most `concurrency` at a time,
    each with the key of its tenant (`SampleRequest.tenant`, else the keys take turns);
    `watch`: processes (name: pid) whose CPU time during the load to record."""
    cfg = ServeConfig(
        url=url,
        model=model,
        api_keys=keys,
        num_tenants=len(keys),
        max_concurrency=concurrency,
        ignore_eos=True,
        percentile_metrics=["ttft"],
        metric_percentiles=[50.0, 99.0],
        show_progress=False,
    )
    watch = watch or {}
    before = {name: cpu_seconds(pid) for name, pid in watch.items()}
    client = time.process_time()
    result, _ = serve_benchmark(cfg, requests)
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in watch.items()}
    cpu["client"] = time.process_time() - client
    if result["failed"]:
        errors = sorted({e for e in result["errors"] if e})
        raise MeasurementError(f"{label}: {result['failed']} requests failed: {errors[:3]}")
    return Run(
        label=label,
        requests=result["completed"],
        concurrency=concurrency,
        duration_s=result["duration"],
        output_tokens=result["total_output_tokens"],
        prompt_tokens=result["total_input_tokens"],
        cached_tokens=result["total_cached_tokens"],
        tokens_per_s=result["output_throughput"],
        ttft_p50_ms=result["median_ttft_ms"],
        ttft_p99_ms=result["p99_ttft_ms"],
        ttfts_ms=[t * 1000 for t in result["ttfts"]],
        cpu_s=cpu,
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_commands(gateway: Process) -> list[dict]:
    """What each supervised worker of `gateway` was started with (its engine options and
    cores, as placement.py chose them), read from the children's command lines."""
    pid = gateway.proc.pid
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
        if "worker" not in argv:
            continue
        options = _flag(argv, "--options")
        out.append(
            {
                "pid": int(child),
                "options": json.loads(options) if options else {},
                "cpus": _flag(argv, "--cpus"),
                "affinity": sorted(os.sched_getaffinity(int(child))),
            }
        )
    return out


def watched(gateway: Process) -> dict[str, int]:
    """The gateway's process and its workers', to pass to `measure(watch=...)`."""
    pids = {"gateway": gateway.proc.pid}
    pids |= {f"worker {i}": w["pid"] for i, w in enumerate(worker_commands(gateway))}
    return pids


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None
