"""The gateway studies' load, written once: a server process pinned to CPU 0 (from this
tree or another commit's checkout), wrk pinned to CPU 1 posting one body, its figures
read from its report, and a process's CPU time from /proc.

studies.gateway_overhead (the gateway against the bare fake backend, and one commit
against another), studies.tracing_overhead and studies.sqlite_wal drive their servers
with these, so their figures are taken the same way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from studies.harness import ADMIN_KEY, tenant_key

CHAT_PATH = "/v1/chat/completions"
UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def pinned(cpu: int) -> list[str]:
    """The taskset prefix that runs a command on `cpu` alone (none on one core)."""
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() > 1 else []


def start_server(
    module_args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """`python -m <module_args>` pinned to CPU 0 (the load comes from CPU 1), output dropped;
    from the source tree `cwd` when given (its modules come before the installed ones)."""
    cmd = [*pinned(0), sys.executable, "-m", *module_args]
    return subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def wait_up(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def start_kvgate(
    port: int, tmp: Path, env: dict[str, str] | None = None, source: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """`kvgate serve --backend fake` on `port` (with `env` over the environment; from the
    source tree `source`, another commit's checkout, when given) and a tenant's key; its
    usage rows go to `tmp`/bench.db."""
    database_url = f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
    env = os.environ | (env or {}) | {"KVGATE_ADMIN_KEY": ADMIN_KEY}
    env["KVGATE_DATABASE_URL"] = database_url
    args = ["gateway.cli", "serve", "--backend", "fake", "--port", str(port)]
    proc = start_server(args, env, source)
    url = f"http://127.0.0.1:{port}"
    wait_up(url)
    return proc, tenant_key(url)


def wrk(
    url: str,
    key: str,
    duration: float,
    tmp: Path,
    conns: int,
    delay_ms: float = 0,
    path: str = CHAT_PATH,
    body: dict | None = None,
) -> str:
    """wrk's report of `conns` connections posting `body` (by default a 16-token chat
    completion) to `path` for `duration` s from CPU 1; an error if any answer failed."""
    body = body or {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 16,
    }
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
        # each connection waits this long between requests: a paced, fixed offered rate
        + (f"function delay() return {delay_ms} end\n" if delay_ms else "")
    )
    flags = ["-t1", f"-c{conns}", f"-d{duration}s", "--latency", "-s", str(script)]
    cmd = [*pinned(1), "wrk", *flags, url + path]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non2xx:
        raise RuntimeError(f"wrk saw {non2xx.group(1)} failed responses:\n{out}")
    return out


def wrk_rps(out: str) -> float:
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


def wrk_requests(out: str) -> int:
    """The requests wrk saw answered."""
    return int(re.search(r"(\d+) requests in", out).group(1))


def wrk_percentile_ms(out: str, p: str) -> float:
    """wrk's `p`th latency percentile ("50", "99") in ms, from its --latency report."""
    value, unit = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
    return float(value) * UNITS_MS[unit]


def cpu_seconds(pid: int) -> float:
    """The process's user and system CPU time so far (taskset execs the server: its pid)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
