"""Issue 45's benchmark items as `python -m studies.hostile_surfaces` tries them: each
side's own `kvgate bench` (`python -m bench` from its checkout) against its gateways,
as a new user would run it:

10. a run given `--api-key`: whether the key is in any history record or in what
    `bench history` prints, and the history directory's and records' modes;
11. a run on a tiny model that often stops at once or says only special tokens: how
    many of its 20 requests count as completed;
12. `bench compare` of two runs of different prompts: whether it refuses, naming what
    differs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from studies.hostile_surfaces_setup import SILENT, Gateway, Outcome, short

WORKLOAD = ["--num-prompts", "20", "--input-len", "8", "--output-len", "6"]


def bench(gw: Gateway, history: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python -m bench ...` from the side's checkout, its history in `history`."""
    env = os.environ | {"KVGATE_BENCH_HISTORY": str(history)}
    return subprocess.run(
        [sys.executable, "-m", "bench", *argv],
        cwd=gw.tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _serve(gw: Gateway, history: Path, key: str, *argv: str) -> subprocess.CompletedProcess:
    run = bench(gw, history, "serve", "--url", gw.url, "--api-key", key, "--no-progress", *argv)
    if run.returncode != 0:
        raise RuntimeError(f"bench serve failed: {run.stderr[-500:]}")
    return run


def no_key_kept(gw: Gateway) -> Outcome:
    """Item 10, on the fake gateway."""
    history = gw.workdir / "bench-history"
    key = gw.tenant("bench")
    _serve(gw, history, key, "--num-prompts", "2", "--input-len", "8", "--output-len", "2")
    records = sorted(history.iterdir())
    holding = sum(key in p.read_text() for p in records)
    printed = key in bench(gw, history, "history").stdout
    modes = {oct(p.stat().st_mode & 0o777)[2:] for p in records}
    dir_mode = oct(history.stat().st_mode & 0o777)[2:]
    figure = (
        f"key in {holding} of {len(records)} records, "
        f"{'in' if printed else 'not in'} `bench history`; directory {dir_mode}, "
        f"records {', '.join(sorted(modes))}"
    )
    ok = holding == 0 and not printed and dir_mode == "700" and modes == {"600"}
    return Outcome(10, "bench history and the API key", ok, figure)


def silent_model(gw: Gateway) -> Outcome:
    """Item 11, on the gpu gateway's `silent` engine: 20 random 8-word prompts."""
    out = gw.workdir / "silent.json"
    history = gw.workdir / "bench-history-silent"
    argv = ["--model", SILENT, *WORKLOAD, "--save-result", str(out)]
    run = bench(gw, history, "serve", "--url", gw.url, "--api-key", gw.tenant("silent"), *argv)
    if not out.exists():
        return Outcome(11, "bench on a model that stops at once", False, short(run.stderr[-200:]))
    result = json.loads(out.read_text())
    errors = {e for e in result["errors"] if e}
    figure = f"{result['completed']} of 20 completed, {result['failed']} failed"
    if errors:
        figure += f" ({short(sorted(errors)[0], 50)})"
    ok = result["completed"] == 20 and result["failed"] == 0
    return Outcome(11, "bench on a model that stops at once", ok, figure)


def compare_workloads(gw: Gateway) -> Outcome:
    """Item 12, on the fake gateway: runs of 8-word and of 16-word prompts."""
    history = gw.workdir / "bench-history-compare"
    key = gw.tenant("bench")
    for words in ("8", "16"):
        _serve(gw, history, key, "--num-prompts", "2", "--input-len", words, "--output-len", "2")
    first, second = sorted(p.stem for p in history.glob("*.json"))
    run = bench(gw, history, "compare", first, second)
    said = (run.stderr + run.stdout).strip().splitlines() or [""]
    naming = [line.strip() for line in said if "input_len" in line]
    if naming:
        figure = f"exit {run.returncode}: {short(naming[0], 70)}"
    else:
        warned = any("WARNING" in line for line in said)
        figure = f"exit {run.returncode}: compared, {'a' if warned else 'no'} warning, no line names input_len"
    return Outcome(
        12, "bench compare of other prompts", run.returncode != 0 and bool(naming), figure
    )
