"""A pytest plugin that counts each test's CPU seconds (user + system, of the test process
and of the processes it started and reaped), for docs/PERF.md's "Issue 46.9": the suite is
CPU-bound, so a cut is measured in CPU seconds, not wall. Run one test or module alone,
with one torch thread as an xdist worker has (idle threads spin on a loaded machine):

    OMP_NUM_THREADS=1 CPU_SECONDS_OUT=cpu.txt .venv/bin/python -m pytest -q -p no:randomly \\
        -p tools.cpu_seconds -n 0 TEST

The table (most first) is appended to CPU_SECONDS_OUT, else printed at the end.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator

import pytest

ROWS: list[tuple[str, float, float, float]] = []


def _cpu() -> tuple[float, float]:
    """(this process's, its reaped children's) CPU seconds."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own, children = _cpu()
    start = time.monotonic()
    yield
    own_after, children_after = _cpu()
    wall = time.monotonic() - start
    ROWS.append((item.nodeid, own_after - own, children_after - children, wall))


def pytest_sessionfinish(session: pytest.Session) -> None:
    rows = sorted(ROWS, key=lambda row: -(row[1] + row[2]))
    lines = [
        f"{own + kids:8.2f} CPU-s (own {own:.2f}, children {kids:.2f}), wall {wall:.2f}  {name}"
        for name, own, kids, wall in rows
    ]
    own, kids = _cpu()
    lines.append(f"whole run, collection included: own {own:.2f}, children {kids:.2f} CPU-s")
    out = os.environ.get("CPU_SECONDS_OUT")
    if out:
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")
    else:
        print("\n" + "\n".join(lines))
