"""What the compile tests of the Triton kernels share: compiling in a subprocess (the
interpreter tests turn TRITON_INTERPRET on for the test process before the kernels are
defined, and interpreted kernels cannot be compiled) and reading its JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SUBPROCESS_TIMEOUT_S = 600
# a compile module's tests wait on its subprocess (LLVM and ptxas for every launch and
# target), which `make test` starts beside its other workers' compiles: past pytest's 300 s
COMPILE_TIMEOUT = pytest.mark.timeout(SUBPROCESS_TIMEOUT_S + 60)


def compile_in_subprocess(module: str) -> list[dict]:
    """The rows `python -m module` prints: one per compiled launch and target."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", module],
        capture_output=True,
        text=True,
        env=env,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def failures(compiled: list[dict]) -> list[str]:
    """The launches that did not compile, each with its error."""
    return [
        f"{r['target']} {r['shape']} {r['kernel']} {r['variant']}: {r['error']}"
        for r in compiled
        if "error" in r
    ]


def over_shared_memory(compiled: list[dict]) -> list[dict]:
    """The launches needing more shared memory than a block may have on their target."""
    return [r for r in compiled if r.get("shared", 0) > r["shared_limit"]]
