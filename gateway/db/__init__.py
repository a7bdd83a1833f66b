"""Persistence: SQLAlchemy 2 (async) tables, engine set-up and Alembic migrations."""

from gateway.db.engine import Database
from gateway.db.outage import is_outage
from gateway.db.schema import migrate
from gateway.db.tables import (
    ApiKey,
    AuditLog,
    Base,
    DailyUsage,
    LoraAdapter,
    PinnedPrefix,
    PrefixBlock,
    Quota,
    QuotaCounter,
    QuotaLease,
    ServerSetting,
    Tenant,
    UsageRecord,
)

__all__ = [
    "ApiKey",
    "AuditLog",
    "Base",
    "DailyUsage",
    "Database",
    "LoraAdapter",
    "PinnedPrefix",
    "PrefixBlock",
    "Quota",
    "QuotaCounter",
    "QuotaLease",
    "ServerSetting",
    "Tenant",
    "UsageRecord",
    "is_outage",
    "migrate",
]
