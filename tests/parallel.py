"""How the suite splits over pytest-xdist's workers (`make test`: `-n 4 --dist loadgroup`).

Most of the suite waits (on served gateways, worker processes, sockets), so four workers
pay even on two cores. Two things keep them from wasting it:

- A module whose tests share a module-scoped fixture (a served gateway, a loaded GGUF
  model, a compile subprocess, a multi-rank group) runs whole on one worker: the
  fixture is made once, as in a serial run. The other tests go one by one to whichever
  worker is free; a module or test may still name its own `xdist_group`.
- The work is handed out longest first (`--no-loadscope-reorder` keeps this order): the
  modules tests/longest_modules.txt names, in its order, then the rest in collection
  order, so no long module starts last and runs alone at the end.

Each worker also runs torch on one thread: four workers of two threads each on two
cores spin against each other. A serial run (no xdist) is left as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    # before anything imports torch: its thread pool is sized at import
    os.environ.setdefault("OMP_NUM_THREADS", "1")

_LISTED = (Path(__file__).parent / "longest_modules.txt").read_text().splitlines()
LONGEST = [line for line in _LISTED if line and not line.startswith("#")]
RANK = {module: rank for rank, module in enumerate(LONGEST)}


def shares_a_module_fixture(item: pytest.Item) -> bool:
    fixtures = getattr(item, "_fixtureinfo", None)
    if fixtures is None:
        return False
    return any(
        d.scope in ("module", "package", "class")
        for defs in fixtures.name2fixturedefs.values()
        for d in defs
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not WORKER:
        return
    shared = {item.path for item in items if shares_a_module_fixture(item)}
    for item in items:
        if item.path in shared and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    # stable: within a module, and among the modules not listed, collection order
    items.sort(key=lambda item: RANK.get(item.nodeid.split("::")[0], len(RANK)))
