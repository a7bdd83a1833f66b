"""Pinned and published prefixes: named system prompts kvgate keeps warm.

A pin is a tenant's system prompt (cached under that tenant's salt) or, with no tenant,
a prefix an admin publishes for every tenant (its blocks are hashed without a salt).
Its text is stored, and kvgate prefills it on every replica serving its model when the
gateway starts and right after it is registered, so the first request after a restart
already hits the cache. A tenant's pins hold KV memory on every replica, so their number
and their tokens are capped per tenant.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import asdict, dataclass, fields

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from tqdm import tqdm

from gateway.backends import Backend, BackendError, GenRequest, SamplingParams
from gateway.db import Database, PinnedPrefix, Tenant
from gateway.routing.catalog import PrefixCatalog
from gateway.routing.router import Router
from gateway.routing.salts import tenant_cache_salt
from gateway.tenancy.audit import audit_row, text_digest
from gateway.tenancy.tenants import Conflict, NotFound

log = logging.getLogger("kvgate.prefix")


class PinCapExceeded(Exception):
    """A tenant's pins would pass max_pins_per_tenant or max_pin_tokens_per_tenant."""


@dataclass(frozen=True)
class PinCaps:
    max_pins: int
    max_tokens: int


@dataclass
class Pin:
    id: str
    tenant_id: str | None  # None: published, shared by every tenant
    name: str
    model: str
    text: str
    shared: bool
    created_at: float
    created_by: str

    def public(self) -> dict:
        return {"object": "prefix"} | asdict(self)

    def audited(self) -> dict:
        """As the audit log keeps it: the text (a tenant's prompt) by its digest only."""
        return self.public() | {"text": text_digest(self.text)}


class PinService:
    def __init__(self, db: Database, router: Router, catalog: PrefixCatalog, secret: str) -> None:
        self.db = db
        self.router = router
        self.catalog = catalog
        self.secret = secret
        self.pins: dict[str, Pin] = {}  # id -> pin
        self.tokens: dict[str, list[int]] = {}  # pin id -> its prefilled tokens
        self.published: dict[str, dict[str, list[int]]] = {}  # model -> pin id -> tokens
        self._creating = asyncio.Lock()  # a cap is checked and the pin stored as one step

    async def load(self) -> None:
        async with self.db.session() as s:
            for row in (await s.scalars(select(PinnedPrefix))).all():
                self.pins[row.id] = _pin(row)

    def list(self, tenant_id: str | None, everyone: bool = False) -> list[Pin]:
        """A tenant's pins and the published ones; `everyone`: all tenants' too."""
        pins = [p for p in self.pins.values() if everyone or p.tenant_id in (None, tenant_id)]
        return sorted(pins, key=lambda p: (p.tenant_id or "", p.name))

    async def tokens_of(self, model: str, text: str) -> list[int]:
        """The tokens every chat with this system prompt starts with, on this model."""
        backend = self.router.pick(model)
        a = await backend.render(model, [_system(text), {"role": "user", "content": "a"}])
        b = await backend.render(model, [_system(text), {"role": "user", "content": "b"}])
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return a[:n]

    async def create(
        self,
        tenant_id: str | None,
        name: str,
        model: str,
        text: str,
        actor: str,
        tokens: list[int],
        caps: PinCaps | None = None,
    ) -> Pin:
        """Store a pin whose `tokens` the caller rendered (to validate it); a tenant's pin
        only within `caps`, else PinCapExceeded."""
        pin_id = f"pfx_{secrets.token_hex(8)}"
        shared = tenant_id is None
        pin = Pin(pin_id, tenant_id, name, model, text, shared, time.time(), actor)
        async with self._creating:
            if tenant_id is not None and caps is not None:
                self._check_caps(tenant_id, len(tokens), caps)
            try:
                async with self.db.session() as s, s.begin():
                    if tenant_id is not None and await s.get(Tenant, tenant_id) is None:
                        raise NotFound(f"no tenant {tenant_id!r}")
                    if tenant_id is None and any(
                        p.tenant_id is None and p.name == name for p in self.pins.values()
                    ):  # NULLs never collide in a unique constraint
                        raise Conflict(f"a published prefix named {name!r} already exists")
                    s.add(PinnedPrefix(**asdict(pin)))
                    s.add(audit_row(actor, "prefix.pin", pin.id, tenant_id, None, pin.audited()))
            except IntegrityError:
                raise Conflict(f"a prefix named {name!r} already exists") from None
            self.pins[pin.id] = pin
            self.tokens[pin.id] = tokens
        return pin

    def held(self, tenant_id: str) -> tuple[int, int]:
        """A tenant's pins: how many, and their tokens (those whose tokens are known)."""
        pins = [p for p in self.pins.values() if p.tenant_id == tenant_id]
        return len(pins), sum(len(self.tokens.get(p.id, ())) for p in pins)

    def _check_caps(self, tenant_id: str, tokens: int, caps: PinCaps) -> None:
        count, held = self.held(tenant_id)
        if count + 1 > caps.max_pins:
            raise PinCapExceeded(
                f"The tenant has {count} pinned prefixes; max_pins_per_tenant is "
                f"{caps.max_pins}. Delete one first."
            )
        if held + tokens > caps.max_tokens:
            raise PinCapExceeded(
                f"The tenant's pinned prefixes hold {held} tokens and this one has {tokens}; "
                f"max_pin_tokens_per_tenant is {caps.max_tokens}."
            )

    async def delete(self, tenant_id: str | None, name: str, actor: str) -> Pin:
        named = (p for p in self.pins.values() if p.tenant_id == tenant_id and p.name == name)
        pin = next(named, None)
        if pin is None:
            raise NotFound(f"no prefix named {name!r}")
        async with self.db.session() as s, s.begin():
            await s.execute(delete(PinnedPrefix).where(PinnedPrefix.id == pin.id))
            s.add(audit_row(actor, "prefix.unpin", pin.id, tenant_id, pin.audited(), None))
        del self.pins[pin.id]
        self.tokens.pop(pin.id, None)
        self.published.get(pin.model, {}).pop(pin.id, None)
        return pin

    def forget_tenant(self, tenant_id: str) -> None:
        """Drop a deleted tenant's pins (the database cascade already removed the rows)."""
        for pin in [p for p in self.pins.values() if p.tenant_id == tenant_id]:
            del self.pins[pin.id]
            self.tokens.pop(pin.id, None)

    def shared_prefix_len(self, model: str, prompt: list[int]) -> int:
        """The longest published prefix of `model` that the prompt starts with."""
        best = 0
        for tokens in self.published.get(model, {}).values():
            if len(tokens) > best and prompt[: len(tokens)] == tokens:
                best = len(tokens)
        return best

    def salt(self, pin: Pin) -> str | None:
        if pin.tenant_id is None:
            return None
        salt = tenant_cache_salt(self.secret, pin.tenant_id)
        self.catalog.note_salt(salt, pin.tenant_id)
        return salt

    def replicas(self, model: str) -> list[Backend]:
        """The replicas a pin of `model` is prefilled on."""
        return [b for b in self.router.serving.get(model, []) if b.name not in self.router.broken]

    async def prefill(self, pin: Pin, tokens: list[int] | None = None) -> int:
        """Prefill the pin on every replica serving its model; returns replicas warmed."""
        backends = self.replicas(pin.model)
        if not backends:
            return 0
        if tokens is None:
            tokens = await self.tokens_of(pin.model, pin.text)
        self.tokens[pin.id] = tokens
        if pin.tenant_id is None:
            self.published.setdefault(pin.model, {})[pin.id] = tokens
        warmed = 0
        for backend in backends:
            try:
                await self._prefill_one(backend, pin, tokens)
                warmed += 1
            except BackendError as e:
                log.warning("prefix %s not prefilled on %s: %s", pin.name, backend.name, e)
        self.catalog.drain(backends)  # the router sees the warm blocks at once
        return warmed

    async def prefill_all(self) -> None:
        pins = list(self.pins.values())
        for pin in tqdm(pins, desc="prefilling pinned prefixes", disable=len(pins) < 2):
            try:
                await self.prefill(pin)
            except Exception:  # one bad pin must not keep the gateway from starting
                log.exception("prefix %s could not be prefilled", pin.name)

    async def _prefill_one(self, backend: Backend, pin: Pin, tokens: list[int]) -> None:
        req = GenRequest(
            f"prefill-{pin.id}-{backend.name}",
            pin.model,
            tokens,
            SamplingParams(temperature=0.0, max_tokens=1),
            tenant_id=pin.tenant_id or "",
            cache_salt=self.salt(pin),
            shared_prefix_len=len(tokens) if pin.tenant_id is None else 0,
        )
        gen = backend.generate(req)
        try:
            async for _ in gen:
                pass
        finally:
            await gen.aclose()


def _system(text: str) -> dict:
    return {"role": "system", "content": text}


def _pin(row: PinnedPrefix) -> Pin:
    """The inverse of `PinnedPrefix(**asdict(pin))`: the table's columns are Pin's fields."""
    return Pin(**{f.name: getattr(row, f.name) for f in fields(Pin)})
