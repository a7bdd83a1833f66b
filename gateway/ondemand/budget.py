"""Which resident models make room for one more, or why none can: at most `models_max`
resident, and their sizes within the memory budget. A model's size is its file's (the
weights llama.cpp maps; its KV cells are a fixed few hundred MB per engine beside them,
n_ctx's). The least recently used idle model goes first; a busy one (a request placed on
it or in flight) is never unloaded under its request. Pure: the caller unloads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GB = 1 << 30
DEFAULT_SHARE = 0.8  # of the machine's memory, when models_memory_gb is unset


@dataclass(frozen=True)
class Resident:
    """A model loaded or loading, as the choice sees it."""

    name: str
    size: int
    last_used: float
    busy: bool


class NoRoom(Exception):
    """The model cannot be loaded now (or ever, where it alone is over the budget)."""


def memory_budget(models_memory_gb: float | None) -> int:
    """Bytes the resident models' files may add up to."""
    if models_memory_gb is not None:
        return int(models_memory_gb * GB)
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * DEFAULT_SHARE)


def make_room(
    name: str, size: int, resident: list[Resident], models_max: int, budget: int
) -> list[str]:
    """The models to unload, least recently used first, so that `name` (`size` bytes)
    fits; NoRoom saying why when it cannot."""
    if size > budget:
        raise NoRoom(
            f"model {name!r} needs {size / GB:.2f} GiB, more than the models' memory budget "
            f"of {budget / GB:.2f} GiB (models_memory_gb)"
        )
    count, used = len(resident), sum(r.size for r in resident)
    leaving = []
    for r in sorted((r for r in resident if not r.busy), key=lambda r: r.last_used):
        if count < models_max and used + size <= budget:
            break
        leaving.append(r.name)
        count, used = count - 1, used - r.size
    if count >= models_max:
        raise NoRoom(
            f"model {name!r} cannot be loaded now: the {models_max} models resident "
            "(models_max) are all serving requests; try again when one is done"
        )
    if used + size > budget:
        raise NoRoom(
            f"model {name!r} ({size / GB:.2f} GiB) does not fit the models' memory budget "
            f"of {budget / GB:.2f} GiB beside the models serving requests now; try again "
            "when one is done"
        )
    return leaving
