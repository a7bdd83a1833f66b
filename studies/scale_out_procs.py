"""The processes and the one measurement studies.scale_out is made of.

A `kvgate serve` or `kvgate worker` started with its output in a log file, ready when
it prints its listening line (the gateway's own, "kvgate: listening on", never a
supervised worker's relayed into the same log); and one load sent with `kvgate bench
serve`'s client (bench.serve), so every figure has vLLM's metric definitions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.datasets import SampleRequest
from bench.serve import ServeConfig, serve_benchmark
from studies.gateway_overhead import free_port

ADMIN_KEY = "kvg-bench-admin-" + "s" * 32
GATEWAY_READY = "kvgate: listening on "
WORKER_READY = "kvgate worker: listening on "  # gateway/worker/cli.py's READY_LINE


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


class Process:
    """A kvgate command whose output goes to `workdir/name.log`; `url` is the address it
    announced on its `ready` line."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        args: list[str],
        ready: str,
        env: dict[str, str] | None = None,
        timeout_s: float = 180,
    ) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *args],
            env=os.environ | (env or {}),
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({self.proc.returncode}):\n{self.tail()}")
            lines = [line for line in self.log.read_text().splitlines() if line.startswith(ready)]
            if lines:
                self.url = lines[0].removeprefix(ready).strip()
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} did not start in {timeout_s:g} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text()[-chars:]

    def stop(self) -> None:
        """SIGTERM (a gateway stops its own workers), SIGKILL if it is still there."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_gateway(
    workdir: Path, name: str, config: str, *flags: str, env: dict[str, str] | None = None
) -> Process:
    """`kvgate serve` on a free port with `config` as its TOML and its own SQLite file,
    unless `env` (over these defaults) names another database."""
    (workdir / f"{name}.toml").write_text(config)
    args = ["--config", str(workdir / f"{name}.toml"), "serve", "--port", str(free_port())]
    defaults = {
        "KVGATE_ADMIN_KEY": ADMIN_KEY,
        "KVGATE_DATABASE_URL": f"sqlite+aiosqlite:///{workdir / name}.db",
    }
    return Process(workdir, name, [*args, *flags], GATEWAY_READY, defaults | (env or {}))


def start_worker(workdir: Path, name: str, token: str, *flags: str) -> Process:
    """`kvgate worker` on a port it picks, callable with `token`."""
    # `=`: a token_urlsafe token may start with "-", which argparse takes for a flag
    args = ["worker", "--port", "0", f"--worker-token={token}", *flags]
    return Process(workdir, name, args, WORKER_READY)


def admin(url: str, method: str, path: str, body: dict | None = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, method=method)
    req.add_header("Authorization", f"Bearer {ADMIN_KEY}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def tenant_key(gateway: Process, name: str = "bench") -> str:
    """An API key of a new tenant whose quotas never bind."""
    limits = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6}
    tenant = admin(gateway.url, "POST", "/admin/tenants", {"name": name, **limits})
    assert isinstance(tenant, dict)
    key = admin(gateway.url, "POST", f"/admin/tenants/{tenant['id']}/keys", {})
    assert isinstance(key, dict)
    return key["key"]


def backend_rows(gateway: Process) -> list[dict]:
    """/admin/backends: each replica's name and counters (where the requests went)."""
    out = admin(gateway.url, "GET", "/admin/backends")
    rows = out["data"] if isinstance(out, dict) else out
    assert isinstance(rows, list)
    return rows


def toml_backend(name: str, kind: str, served: str, model: str = "", **options: object) -> str:
    """One [[backends]] entry; options as its table (JSON values are valid TOML here)."""
    lines = [
        "[[backends]]",
        f'name = "{name}"',
        f'type = "{kind}"',
        f'served_model_name = "{served}"',
    ]
    if model:
        lines.append(f"model = {json.dumps(model)}")
    lines.append("[backends.options]")
    lines += [f"{key} = {json.dumps(value)}" for key, value in options.items()]
    return "\n".join(lines) + "\n"


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
