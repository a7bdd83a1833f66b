"""The tables. Times are UNIX seconds (floats): one representation on SQLite and PostgreSQL."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    quota: Mapped[Quota] = relationship(
        back_populates="tenant", cascade="all, delete-orphan", uselist=False, lazy="joined"
    )


class Limits:
    """The limit columns a tenant's quota and an API key both hold (NULL: no limit); the
    money budgets in nanodollars (10^-9 USD, gateway.tenancy.quota.prices), dollars at the API."""

    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    daily_tokens: Mapped[int | None] = mapped_column(BigInteger)
    monthly_tokens: Mapped[int | None] = mapped_column(BigInteger)
    daily_spend: Mapped[int | None] = mapped_column(BigInteger)
    monthly_spend: Mapped[int | None] = mapped_column(BigInteger)
    models: Mapped[list[str] | None] = mapped_column(JSON)


class Quota(Limits, Base):
    """A tenant's limits; NULL means unlimited."""

    __tablename__ = "quotas"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    priority: Mapped[int] = mapped_column(Integer, default=0)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    tenant: Mapped[Tenant] = relationship(back_populates="quota")


class ApiKey(Limits, Base):
    """Only the SHA-256 of a key is stored, with a short visible prefix to find it by.
    Its limits are the tenant's fields, held beside the tenant's; NULL: no limit of its own."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    name: Mapped[str] = mapped_column(String(200), default="")
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list[str]] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)
    # the key's default priority (vLLM's, lower first); NULL: its tenant's. It only
    # yields: a key never runs ahead of its tenant's priority (gateway.tenancy.auth)
    priority: Mapped[int | None] = mapped_column(Integer)


class UsageRecord(Base):
    __tablename__ = "usage_records"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float] = mapped_column(Float)
    status: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    user: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float)
    # "engine", or "gateway" where a remote upstream sent no usage and kvgate counted
    counted_by: Mapped[str] = mapped_column(String(16), server_default="engine")
    # what the request cost at its model's price, in nanodollars (gateway.tenancy.quota.prices)
    spend_nano_usd: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # a Batch API line's (gateway/batches): unique together, so it is billed once
    batch_id: Mapped[str | None] = mapped_column(String(40))
    custom_id: Mapped[str | None] = mapped_column(String(200))
    # of prompt_tokens, how many came from images (the engine's or upstream's count)
    image_tokens: Mapped[int] = mapped_column(Integer, server_default="0")

    __table_args__ = (
        Index("ix_usage_records_tenant_created", "tenant_id", "created_at"),
        Index("ux_usage_records_batch_line", "batch_id", "custom_id", unique=True),
    )


class DailyUsage(Base):
    __tablename__ = "daily_usage"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    day: Mapped[str] = mapped_column(String(10), primary_key=True)  # YYYY-MM-DD, UTC
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    spend_nano_usd: Mapped[int] = mapped_column(BigInteger, server_default="0")
    image_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")


class QuotaCounter(Base):
    """Shared quota windows for several gateways on one PostgreSQL database."""

    __tablename__ = "quota_counters"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    window: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)
    limit_value: Mapped[int | None] = mapped_column(BigInteger)


class QuotaLease(Base):
    """Concurrency slots each gateway holds, so a crashed one's slots can be taken back."""

    __tablename__ = "quota_leases"

    instance_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    held: Mapped[int] = mapped_column(Integer)
    heartbeat: Mapped[float] = mapped_column(Float, index=True)
    # on the tenant's own row (PostgreSQL): the gateway's last admission call for the
    # tenant that admitted something, and the batch indices it admitted (a JSON array)
    last_call: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    last_admitted: Mapped[str | None] = mapped_column(Text, nullable=True)


class AuditLog(Base):
    """One admin change (gateway.tenancy.audit): who (the admin credential's id), what (an
    action on a target, the tenant it concerns) and the object before and after (JSON)."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(200))  # an adapter's name is up to 200
    tenant_id: Mapped[str | None] = mapped_column(String(32), index=True)
    before: Mapped[dict | None] = mapped_column(JSON(none_as_null=True))
    after: Mapped[dict | None] = mapped_column(JSON(none_as_null=True))


class ServerSetting(Base):
    """Values the server generates once and must keep across restarts (the cache-salt
    secret; the KV tiers' secret, made by migration 0012), and the auth epoch every key
    and tenant change rewrites (gateway.tenancy.auth)."""

    __tablename__ = "server_settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class PrefixBlock(Base):
    """One prompt block a replica holds in its prefix cache (the catalog, batched writes)."""

    __tablename__ = "prefix_blocks"

    replica: Mapped[str] = mapped_column(String(200), primary_key=True)
    block_hash: Mapped[str] = mapped_column(String(128), primary_key=True)
    parent_hash: Mapped[str | None] = mapped_column(String(128))
    tenant_id: Mapped[str | None] = mapped_column(String(32), index=True)  # NULL: published
    num_tokens: Mapped[int] = mapped_column(Integer)
    hits: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens_saved: Mapped[int] = mapped_column(BigInteger, default=0)
    first_seen: Mapped[float] = mapped_column(Float)
    last_used: Mapped[float] = mapped_column(Float)


class PinnedPrefix(Base):
    """A named system prompt kvgate prefills on every backend start (NULL tenant: published)."""

    __tablename__ = "pinned_prefixes"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    text: Mapped[str] = mapped_column(Text)
    shared: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)
    created_by: Mapped[str] = mapped_column(String(64))

    __table_args__ = (UniqueConstraint("tenant_id", "name"),)


class LoraAdapter(Base):
    """A LoRA adapter registered through the admin API (gateway.routing.adapters): served
    on the replicas of `base_model`; a tenant's (NULL: public) is that tenant's alone."""

    __tablename__ = "lora_adapters"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    base_model: Mapped[str] = mapped_column(String(200))
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    created_at: Mapped[float] = mapped_column(Float)
    created_by: Mapped[str] = mapped_column(String(64))
