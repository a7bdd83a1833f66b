"""LoRA adapters: the registry of the adapters a gateway serves over its base models.

An adapter is a name clients send as `model`, a path (a PEFT directory for the gpu
engine, a GGUF file for llama.cpp, the upstream's own name for a third-party server) and
the base model whose replicas run it. Public ones come from the config (`lora_modules`,
vLLM's flag, kept in memory) or an admin; a tenant's is registered by an admin and exists
for that tenant's keys alone: for any other key it is an unknown model (`visible`).

Registration asks every replica of the base model to check the adapter first
(`LoraBackend.check_adapter`: the engine reads its files against its model), so a bad
one is refused whole with the engine's reason and nothing is stored. Deletion hides the
adapter at once; its requests in flight finish, and only then are the replicas told to
drop it (`remove_adapter`). On PostgreSQL, where other gateways register and delete
adapters too, the table is read again every REFRESH_S.

An adapter whose files break after registration fails its requests (the engine's
AdapterLoadError, a 503 `adapter_load_failed` for the client): the registry logs each
failure and shows the adapter `failed`, with the engine's reason, until a request under
it is served again (the files mended).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, fields

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from gateway.backends import (
    GENERATE,
    AdapterLoadError,
    AdapterRef,
    BackendError,
    BadRequestError,
    LoraBackend,
)
from gateway.db import Database, LoraAdapter, Tenant
from gateway.routing.router import Router
from gateway.tenancy.audit import audit_row
from gateway.tenancy.tenants import NotFound

log = logging.getLogger("kvgate.adapters")
CONFIGURED = "config"  # created_by of the adapters the config names (lora_modules)
REFRESH_S = 2.0


class AdapterError(ValueError):
    """A registration or deletion refused, with what is wrong (a 400 for the client)."""


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    base_model: str
    tenant_id: str | None  # None: public
    created_at: float
    created_by: str

    @property
    def ref(self) -> AdapterRef:
        return AdapterRef(self.name, self.path)

    def public(self) -> dict:
        return {"object": "adapter"} | asdict(self)


class AdapterRegistry:
    def __init__(self, db: Database, router: Router) -> None:
        self.db = db
        self.router = router
        self.adapters: dict[str, Adapter] = {}
        self.in_flight: dict[str, int] = {}  # adapter name -> its requests now
        self.failed: dict[str, str] = {}  # adapter name -> why its last load failed
        self._idle: dict[str, asyncio.Event] = {}  # set while an adapter has no requests
        self._changing = asyncio.Lock()  # a name is checked and stored as one step
        self._unloads: set[asyncio.Task] = set()
        self._shadowed: set[str] = set()  # stored names the config's lora_modules took
        self._refresh: asyncio.Task | None = None

    async def load(self) -> None:
        """The stored adapters as the table has them now (a configured one wins a name);
        those gone from it (another gateway deleted them) are unloaded here too. Read
        under the lock: a registration here is in the table or not begun."""
        async with self._changing:
            async with self.db.session() as s:
                rows = (await s.scalars(select(LoraAdapter))).all()
            stored = {
                r.name: Adapter(**{f.name: getattr(r, f.name) for f in fields(Adapter)})
                for r in rows
            }
            for adapter in list(self.adapters.values()):
                if adapter.created_by != CONFIGURED and adapter.name not in stored:
                    del self.adapters[adapter.name]
                    self._unload_later(adapter)
            for name, adapter in stored.items():
                known = self.adapters.setdefault(name, adapter)
                if known.created_by == CONFIGURED and name not in self._shadowed:
                    self._shadowed.add(name)
                    log.warning(
                        "adapter %s: the config's lora_modules names it too; theirs wins", name
                    )

    def start(self) -> None:
        """On PostgreSQL, read the table again every REFRESH_S (other gateways' changes)."""
        if self.db.is_postgres:
            self._refresh = asyncio.create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.load()
            except Exception as e:  # the database away: the adapters known stay served
                log.warning("LoRA adapters not read again: %s", e)

    async def add_configured(self, name: str, path: str, base_model: str) -> None:
        """A public adapter from the config, checked on the base model's healthy replicas;
        one they refuse is logged and not served (the gateway serves the rest)."""
        adapter = Adapter(name, path, base_model, None, time.time(), CONFIGURED)
        try:
            self._check_name(name)
            await self._check_on_replicas(adapter, require_healthy=False)
        except (AdapterError, BadRequestError) as e:
            log.error("LoRA adapter %s (lora_modules) is not served: %s", name, e)
            return
        self.adapters[name] = adapter

    def visible(self, name: str, tenant_id: str | None) -> Adapter | None:
        """The adapter `name` as a key of `tenant_id` sees it: another tenant's is None."""
        adapter = self.adapters.get(name)
        if adapter is None or adapter.tenant_id not in (None, tenant_id):
            return None
        return adapter

    def usable(self, tenant_id: str | None) -> list[Adapter]:
        """The adapters a key of `tenant_id` may name: its tenant's and the public ones."""
        usable = (a for a in self.adapters.values() if a.tenant_id in (None, tenant_id))
        return sorted(usable, key=lambda a: a.name)

    def all(self) -> list[Adapter]:
        return sorted(self.adapters.values(), key=lambda a: (a.tenant_id or "", a.name))

    def described(self, adapter: Adapter) -> dict:
        """The adapter as the admin API shows it: with its state, `ready` or `failed`,
        and why it failed."""
        why = self.failed.get(adapter.name)
        return adapter.public() | {"state": "failed" if why else "ready", "error": why}

    def load_failed(self, e: AdapterLoadError, replica: str) -> None:
        """A request's adapter would not load on `replica`: logged, and shown failed."""
        log.error("LoRA adapter %s failed to load on %s: %s", e.adapter, replica, e.reason)
        if e.adapter in self.adapters:
            self.failed[e.adapter] = f"{replica}: {e.reason}"

    def base_of(self, model: str) -> str | None:
        adapter = self.adapters.get(model)
        return adapter.base_model if adapter else None

    async def register(
        self, name: str, path: str, base_model: str, tenant_id: str | None, actor: str
    ) -> Adapter:
        """Check the adapter on every replica of `base_model`, then store it; AdapterError
        (or the engine's BadRequestError) naming the problem, and nothing stored."""
        adapter = Adapter(name, path, base_model, tenant_id, time.time(), actor)
        async with self._changing:
            self._check_name(name)
            await self._check_on_replicas(adapter, require_healthy=True)
            try:
                async with self.db.session() as s, s.begin():
                    if tenant_id is not None and await s.get(Tenant, tenant_id) is None:
                        raise NotFound(f"no tenant {tenant_id!r}")
                    s.add(LoraAdapter(**asdict(adapter)))
                    after = adapter.public()
                    s.add(audit_row(actor, "adapter.create", name, tenant_id, None, after))
            except IntegrityError:  # another gateway on this database stored it first
                raise AdapterError(f"the name {name!r} is taken by another adapter") from None
            self.adapters[name] = adapter
        return adapter

    def _check_name(self, name: str) -> None:
        if name in self.adapters:
            raise AdapterError(f"the name {name!r} is taken by another adapter")
        if name in self.router.cards:
            raise AdapterError(f"the name {name!r} is taken by a model")

    async def _check_on_replicas(self, adapter: Adapter, require_healthy: bool) -> None:
        card = self.router.cards.get(adapter.base_model)
        if card is None:
            raise AdapterError(f"no base model {adapter.base_model!r} is served here")
        if card.task != GENERATE:
            raise AdapterError(f"the model {adapter.base_model!r} does not generate text")
        replicas: list[LoraBackend] = []
        for backend in self.router.serving.get(adapter.base_model, []):
            if not isinstance(backend, LoraBackend):
                raise AdapterError(
                    f"the backend {backend.name} of {card.id!r} serves no LoRA adapters"
                )
            if backend.name not in self.router.broken and backend.stats().healthy:
                replicas.append(backend)
        if not replicas and require_healthy:
            raise BackendError(f"no replica of {card.id!r} is up to check the adapter")
        # every replica says yes before anything is stored (one engine's limits may differ)
        await asyncio.gather(*(b.check_adapter(adapter.ref) for b in replicas))

    async def delete(self, name: str, actor: str) -> Adapter:
        """Hide the adapter now; unload it from its replicas once its requests end."""
        async with self._changing:
            adapter = self.adapters.get(name)
            if adapter is None:
                raise NotFound(f"no adapter {name!r}")
            if adapter.created_by == CONFIGURED:
                raise AdapterError(f"the adapter {name!r} is set in the config (lora_modules)")
            async with self.db.session() as s, s.begin():
                await s.execute(delete(LoraAdapter).where(LoraAdapter.name == name))
                before = adapter.public()
                s.add(audit_row(actor, "adapter.delete", name, adapter.tenant_id, before, None))
            del self.adapters[name]
        self._unload_later(adapter)
        return adapter

    def _unload_later(self, adapter: Adapter) -> None:
        self.failed.pop(adapter.name, None)
        task = asyncio.create_task(self._unload(adapter))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def _unload(self, adapter: Adapter) -> None:
        idle = self._idle.get(adapter.name)
        if idle is not None:
            await idle.wait()
        for backend in self.router.serving.get(adapter.base_model, []):
            if isinstance(backend, LoraBackend):
                await _remove(backend, adapter.name)

    def forget_tenant(self, tenant_id: str) -> None:
        """Drop a deleted tenant's adapters (the database cascade removed their rows)."""
        for adapter in [a for a in self.adapters.values() if a.tenant_id == tenant_id]:
            del self.adapters[adapter.name]
            self.failed.pop(adapter.name, None)

    def acquire(self, name: str) -> None:
        """A request runs under the adapter until `release`."""
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        self._idle.setdefault(name, asyncio.Event()).clear()

    def release(self, name: str, served: bool) -> None:
        """A request under the adapter ended; `served`: its output came (it loaded)."""
        if served:
            self.failed.pop(name, None)
        self.in_flight[name] -= 1
        if not self.in_flight[name]:
            del self.in_flight[name]
            self._idle.pop(name).set()

    async def stop(self) -> None:
        """Wait for the unloads under way (a stopping gateway drains its requests first)."""
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)
            self._refresh = None
        if self._unloads:
            await asyncio.gather(*self._unloads, return_exceptions=True)


async def _remove(backend: LoraBackend, name: str) -> None:
    try:
        await backend.remove_adapter(name)
    except Exception as e:  # the adapter is gone from the registry either way
        log.warning("adapter %s: %s could not drop it: %s", name, backend.name, e)
