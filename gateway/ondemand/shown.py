"""How a models directory's backend reads in `/admin/backends` and `/metrics`. Its
engine runs only while the model is loaded, so its own stats say unhealthy the rest of
the time; that is not a failure (the model loads on its first request, and `/health`
leaves it out for the same reason). Such a backend reads healthy with `loaded` false
(`kvgate:backend_loaded` 0); one whose engine runs reads as its engine says.
"""

from __future__ import annotations

import dataclasses

from gateway.backends import Backend, BackendStats
from gateway.observe.metrics import LOADED
from gateway.ondemand.resident import of
from gateway.state import GatewayState


def shown_stats(gw: GatewayState, backend: Backend) -> BackendStats:
    """`backend.stats()`, where a models directory's model not loaded (or still
    loading) reads healthy and `extra["loaded"]` False."""
    stats = backend.stats()
    models = of(gw)
    if models is None or not models.not_up(backend):
        return stats
    return dataclasses.replace(stats, healthy=True, extra=stats.extra | {LOADED: False})


def is_loaded(stats: BackendStats) -> bool:
    """Whether the backend's engine is loaded (every configured one is)."""
    return bool(stats.extra.get(LOADED, True))
