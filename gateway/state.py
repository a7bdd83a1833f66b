"""Everything a running gateway holds, as one typed record (no module globals), and the
aiohttp app key the routes find it under. gateway.lifecycle builds and stops it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

from aiohttp import web

from gateway.backends import Backend, BackendStats
from gateway.config import Settings
from gateway.config_load import ConfigSource
from gateway.db import Database
from gateway.http.drain import Drain
from gateway.http.errors import ApiError
from gateway.observe.metrics import Metrics
from gateway.observe.stats import TrafficStats
from gateway.observe.tracing import TENANT, Tracing, step
from gateway.routing.adapters import AdapterRegistry
from gateway.routing.catalog import PrefixCatalog
from gateway.routing.fair_queue import FairQueue
from gateway.routing.pins import PinService
from gateway.routing.router import Router
from gateway.tenancy.auth import Authenticator, AuthError, Principal, missing_scope
from gateway.tenancy.quota import QuotaStore
from gateway.tenancy.quota.prices import Price
from gateway.tenancy.tenants import TenantService
from gateway.tenancy.usage import UsageRecorder
from gateway.worker_pool.supervisor import WorkerSupervisor

INFERENCE_PATHS = ("/v1/", "/api/")  # POSTs under these are served work (OpenAI, Ollama)


@dataclass
class GatewayState:
    settings: Settings
    db: Database
    tenants: TenantService
    auth: Authenticator
    quota: QuotaStore
    usage: UsageRecorder
    router: Router
    metrics: Metrics
    traffic: TrafficStats
    secret: str
    kv_tier_secret: str = field(repr=False)  # the engines' KV records' MAC key (lifecycle)
    catalog: PrefixCatalog
    pins: PinService
    adapters: AdapterRegistry
    backends: list[Backend] = field(default_factory=list)
    backend_types: dict[str, str] = field(default_factory=dict)
    generated_admin_key: str | None = None
    starter_key: str | None = None  # the starter tenant's, made beside a generated admin key
    url: str = ""
    supervisors: list[WorkerSupervisor] = field(default_factory=list)  # --workers N
    # backend name -> the gateway's fair queue, for backends whose scheduler is not
    # kvgate's (an adapter with `max_in_flight`)
    queues: dict[str, FairQueue] = field(default_factory=dict)
    # OpenTelemetry traces (gateway/observe/tracing.py); None: off, and no span is made
    tracing: Tracing | None = None
    # SIGTERM's drain (gateway/http/drain.py): the inference routes are its work
    drain: Drain = field(default_factory=lambda: Drain(INFERENCE_PATHS))
    # each backend's output parsers (gateway.serving.parser_choice), chosen on first ask;
    # weak: a reload's new backends are chosen for afresh, the old ones' choices go
    parser_choices: WeakKeyDictionary[Backend, Any] = field(default_factory=WeakKeyDictionary)
    # config entry name -> its replicas, what a reload adds, replaces or removes whole
    entries: dict[str, list[Backend]] = field(default_factory=dict)
    # how the settings were read, to read them again on a reload (None: cannot reload)
    source: ConfigSource | None = None
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one reload at a time
    # replicas a reload removed, waiting for their requests to finish before they stop
    retiring: set[asyncio.Task] = field(default_factory=set)
    # --models-dir: gateway.ondemand.ModelsDir, the directory's models loaded on demand
    # (typed loosely: it lives in a room above this one)
    models_dir: Any = None

    async def authenticate(self, request: web.Request, scope: str = "inference") -> Principal:
        with step(self.tracing, "kvgate.authenticate") as span:
            principal = await self._authenticate(request, scope)
            if span is not None and principal.tenant_id is not None:
                span.set_attribute(TENANT, principal.tenant_id)
            return principal

    async def _authenticate(self, request: web.Request, scope: str) -> Principal:
        try:
            authorization = request.headers.get("Authorization")
            if authorization is None and "x-api-key" in request.headers:  # Anthropic's clients
                authorization = "Bearer " + request.headers["x-api-key"]
            principal = await self.auth.authenticate(authorization)
        except AuthError as e:
            raise ApiError(401, str(e), code="invalid_api_key") from None
        if scope not in principal.scopes:
            raise ApiError(403, missing_scope(principal, scope))
        return principal

    def price_of(self, model: str) -> Price:
        """The model's prices; an adapter without its own, its base model's."""
        if model not in self.settings.prices and (base := self.adapters.base_of(model)):
            return self.settings.price_of(base)
        return self.settings.price_of(model)


def with_queue(stats: BackendStats, queues: dict[str, FairQueue]) -> BackendStats:
    """A backend's stats with its fair queue's per-tenant figures, where the gateway
    queues in front of it (the gpu engine reports its own)."""
    queue = queues.get(stats.name)
    if queue is None:
        return stats
    return dataclasses.replace(stats, extra=stats.extra | {"tenants": queue.stats()})


GW = web.AppKey("gateway", GatewayState)
