"""A gateway's start and stop: the database migrated, the services built in order, the
workers and backends started (one that fails is reported, not fatal), the pins
prefilled; and the reverse, each step's failure logged so the rest still stop.

The engines get the KV tiers' secret (`kv_tier_secret`, else the database's) as an
engine option in-process and as an environment variable in a worker, never on its
command line.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

from gateway.backends import Backend, BackendSpec, ModelCard, build_backends
from gateway.config import Settings
from gateway.config_backends import with_kv_tier_secret
from gateway.db import Database, migrate
from gateway.db.tables import ServerSetting
from gateway.http.drain import Drain
from gateway.observe.metrics import Metrics
from gateway.observe.stats import TrafficStats
from gateway.ondemand import ModelsDir
from gateway.ondemand.shown import shown_stats
from gateway.routing.adapters import AdapterRegistry
from gateway.routing.catalog import PrefixCatalog
from gateway.routing.fair_queue import FairQueue
from gateway.routing.pins import PinService
from gateway.routing.router import Router
from gateway.routing.salts import tenant_cache_salt
from gateway.state import GatewayState, with_queue
from gateway.tenancy.auth import Authenticator
from gateway.tenancy.quota import MemoryQuotaStore, QuotaStore
from gateway.tenancy.quota.postgres import PostgresQuotaStore
from gateway.tenancy.tenants import TenantService
from gateway.tenancy.usage import UsageRecorder
from gateway.worker_pool.pool import start_workers, stop_workers
from gateway.worker_pool.supervisor import WorkerSupervisor

log = logging.getLogger("kvgate")
KV_TIER_SECRET = "kv_tier_secret"  # its server_settings row (migration 0012)


async def start_gateway(settings: Settings, drain: Drain | None = None) -> GatewayState:
    db = Database(settings.database_url, settings.database_schema, settings.sqlite_wal_limit_bytes)
    await migrate(db)
    tenants = TenantService(db)
    generated = await tenants.ensure_admin_key(settings.admin_key)
    # a first start that made the admin key makes a tenant key too: one paste to a chat
    starter_key = await tenants.create_starter() if generated else None
    secret = await tenants.server_secret(settings.secret)
    kv_secret = settings.kv_tier_secret or await stored_kv_tier_secret(db)
    quota = await _start_quota(db, tenants)
    usage = UsageRecorder(db)
    usage.start()
    catalog = await _load_catalog(db, tenants, settings.instance, secret)
    router = Router([], settings.router_policy, catalog)
    queues: dict[str, FairQueue] = {}
    state = GatewayState(
        settings=settings,
        db=db,
        tenants=tenants,
        auth=Authenticator(db, settings.key_cache_ttl_s),
        quota=quota,
        usage=usage,
        router=router,
        # (read at scrape time, once `state` exists)
        metrics=Metrics(
            lambda: [with_queue(shown_stats(state, b), queues) for b in router.backends]
        ),
        queues=queues,
        traffic=TrafficStats(),
        secret=secret,
        kv_tier_secret=kv_secret,
        catalog=catalog,
        pins=PinService(db, router, catalog, secret),
        adapters=AdapterRegistry(db, router),
        generated_admin_key=generated,
        starter_key=starter_key,
    )
    if drain is not None:  # the app's, which its middleware reads
        state.drain = drain
    await _start_backends(state)
    if settings.models_dir:  # its models are listed now, loaded on their first request
        state.models_dir = ModelsDir(state, settings)
        await state.models_dir.start()
    await state.adapters.load()
    state.adapters.start()
    # the engines start empty: prefill the pinned prefixes, so the first request hits
    await state.pins.load()
    await state.pins.prefill_all()
    catalog.start(lambda: router.backends)
    if state.auth.listener is not None:
        state.auth.listener.start()
    return state


async def stored_kv_tier_secret(db: Database) -> str:
    """The KV tiers' secret that migration 0012 generated into the database, the same for
    every gateway on it (one it lacks, deleted by hand, is generated again)."""
    async with db.session() as s, s.begin():
        row = await s.get(ServerSetting, KV_TIER_SECRET)
        if row is None:
            row = ServerSetting(key=KV_TIER_SECRET, value=secrets.token_hex(32))
            s.add(row)
        return row.value


async def _start_quota(db: Database, tenants: TenantService) -> QuotaStore:
    """The quota counters: in PostgreSQL, shared by every gateway on it; else in memory,
    preloaded with the usage already committed in the open windows."""
    quota: QuotaStore
    if db.is_postgres:
        quota = PostgresQuotaStore(db)
    else:
        quota = MemoryQuotaStore()
        now = time.time()
        for tenant_id, used in (await tenants.committed_usage(now)).items():
            quota.preload(tenant_id, used, now)
    await quota.start()
    return quota


async def _load_catalog(
    db: Database, tenants: TenantService, instance: str, secret: str
) -> PrefixCatalog:
    """The prefix catalog as stored, knowing every tenant's cache salt."""
    catalog = PrefixCatalog(db, instance)
    await catalog.load()
    for tenant in await tenants.list_tenants():
        catalog.note_salt(tenant_cache_salt(secret, tenant["id"]), tenant["id"])
    return catalog


@dataclass
class Started:
    """Replicas built from config entries and started, not yet routed to."""

    backends: list[tuple[Backend, str]] = field(default_factory=list)  # (replica, its type)
    by_entry: dict[str, list[Backend]] = field(default_factory=dict)  # entry -> replicas
    supervisors: list[WorkerSupervisor] = field(default_factory=list)  # --workers N
    broken: dict[str, str] = field(default_factory=dict)  # replica -> why it did not start


async def _start_backends(state: GatewayState) -> None:
    """Start the workers and every replica of every backend, route to them, and add the
    public adapters the entries name."""
    configured = state.settings.resolved_backends(starter=True)
    started = await start_entries(state, configured)
    route(state, started, state.settings.fairness)
    await add_entry_adapters(state, configured, started)


async def start_entries(state: GatewayState, configured: list[BackendSpec]) -> Started:
    """The workers of `configured` (with --workers) and each entry's replicas, started;
    one that fails to start is in `broken` (not fatal: its model answers 503 with why)."""
    settings = state.settings

    async def on_restart(url: str) -> None:
        log.info("worker %s restarted with an empty cache: prefilling the pins again", url)
        await state.pins.prefill_all()

    # the workers key their KV records as the gateway's engines do, and trace where the
    # gateway does, however it was told (flag, file, variable)
    env = {"KVGATE_KV_TIER_SECRET": state.kv_tier_secret}
    if endpoint := settings.otlp_traces_endpoint:
        env["KVGATE_OTLP_TRACES_ENDPOINT"] = endpoint
    # a worker takes the images the gateway takes: its body limit makes room for their
    # files, and it decodes them within the same limits (remote_images.py)
    for name in ("max_body_bytes", "max_image_bytes", "max_image_pixels", "max_images_per_request"):
        env["KVGATE_" + name.upper()] = str(getattr(settings, name))
    specs, supervisors = await start_workers(
        configured, settings.workers, on_restart, settings.prefill_workers, env
    )
    started = Started(supervisors=supervisors)
    for spec in specs:
        # one per replica; an in-process engine takes the secret as an option
        for backend in build_backends(with_kv_tier_secret(spec, state.kv_tier_secret)):
            started.by_entry.setdefault(spec.name, []).append(backend)
            started.backends.append((backend, spec.type))
            try:
                await backend.start()
            except Exception as e:  # one broken backend must not take the gateway down
                # the reason is one line (kvgate serve prints it); the traceback is for --verbose
                log.debug("backend %s failed to start", backend.name, exc_info=True)
                started.broken[backend.name] = f"backend {backend.name} failed to start: {e}"
    return started


def route(state: GatewayState, started: Started, fairness: str | None) -> None:
    """The started replicas join the router, with a fair queue in front of each whose
    scheduler is not kvgate's (an adapter with `max_in_flight`). No await: requests see
    all of them or none."""
    router = state.router
    for backend, kind in started.backends:
        state.backends.append(backend)
        state.backend_types[backend.name] = kind
        router.backends.append(backend)
        if backend.name in started.broken:
            router.broken[backend.name] = started.broken[backend.name]
            _keep_models(router, backend)
        else:
            router.add_models(backend)
        slots = getattr(backend, "max_in_flight", None)
        if slots is not None:
            state.queues[backend.name] = FairQueue(slots, fairness or "vtc")
    state.entries |= started.by_entry
    state.supervisors += started.supervisors


async def add_entry_adapters(
    state: GatewayState, configured: list[BackendSpec], started: Started
) -> None:
    """The public adapters each entry names, over its model."""
    for spec in configured:
        for module in spec.lora_modules:
            models = [c.id for b in started.by_entry.get(spec.name, [])[:1] for c in _cards(b)]
            base = module.base_model or (models[0] if models else "")
            await state.adapters.add_configured(module.name, module.path, base)


def _cards(backend: Backend) -> list[ModelCard]:
    try:
        return backend.models()
    except Exception:  # unstarted, and it cannot tell: its adapters have no base model
        return []


def _keep_models(router: Router, backend: Backend) -> None:
    """A backend that failed to start keeps its models known, with the cards its config
    gives: a request for one is a 503 that says why (Router.candidates), not a 404."""
    try:
        router.add_models(backend)
    except Exception:  # an adapter that cannot tell its cards unstarted: the model is absent
        log.debug("backend %s has no model cards unstarted", backend.name, exc_info=True)


async def stop_gateway(state: GatewayState) -> None:
    # backends a reload removed finish draining first (their requests ended with the drain)
    await asyncio.gather(*state.retiring, return_exceptions=True)
    await state.adapters.stop()
    if state.models_dir is not None:
        await state.models_dir.stop()
    for backend in state.backends:
        try:
            await backend.stop(drain=True)
        except Exception:
            log.exception("backend %s failed to stop", backend.name)
    await stop_workers(state.supervisors)
    try:
        await state.catalog.stop()
    except Exception:
        log.exception("the prefix catalog's last flush failed")
    if state.auth.listener is not None:
        await state.auth.listener.stop()
    await state.usage.stop()
    await state.quota.close()
    await state.db.close()
