"""The limits a tenant and a key may have are listed once (gateway.tenancy.quota.limits.LIMITS).
The request bodies and response models are built from that list; the quota's record and the
database's columns are written out (gateway.tenancy.quota.limits.LimitField says why), so
this holds them to it."""

from __future__ import annotations

from dataclasses import fields

from sqlalchemy import JSON, BigInteger, Integer

from gateway.db import tables
from gateway.schemas import responses_admin
from gateway.schemas.admin import KeyCreate, KeyUpdate, TenantCreate, TenantUpdate
from gateway.tenancy.quota.limits import (
    COUNT32,
    COUNT53,
    COUNTED_LIMITS,
    KINDS,
    LIMIT_FIELDS,
    LIMITS,
    MODELS,
    USD,
    QuotaLimits,
)

_COLUMN = {COUNT32: Integer, COUNT53: BigInteger, USD: BigInteger, MODELS: JSON}


def _run(names: list[str]) -> list[str]:
    """The limit fields among `names`, where they start: they stand together, in order."""
    start = names.index(LIMIT_FIELDS[0])
    return names[start : start + len(LIMIT_FIELDS)]


def test_bodies_and_responses_have_the_limits_in_order():
    models = (TenantCreate, TenantUpdate, KeyCreate, KeyUpdate)
    models += (responses_admin.Tenant, responses_admin.ApiKey, responses_admin.ApiKeyCreated)
    for model in models:
        assert _run(list(model.model_fields)) == list(LIMIT_FIELDS), model.__name__


def test_quota_record_holds_the_counted_limits():
    declared = [f.name for f in fields(QuotaLimits)]
    assert declared[: len(COUNTED_LIMITS)] == list(COUNTED_LIMITS)
    assert set(LIMIT_FIELDS) - set(COUNTED_LIMITS) == {"models"}
    assert sorted(f.counter for f in LIMITS if f.counter is not None) == sorted(KINDS)


def test_columns_are_the_limits_of_their_kind():
    assert list(tables.Limits.__annotations__) == list(LIMIT_FIELDS)
    for table in (tables.Quota, tables.ApiKey):
        for f in LIMITS:
            assert isinstance(table.__table__.columns[f.name].type, _COLUMN[f.holds]), f.name
