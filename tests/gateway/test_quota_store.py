"""Both quota stores, same rules: exact limits, refusals take nothing, settle corrects;
a key's own limits hold beside its tenant's, the stricter one refusing, and a refusal by
either takes nothing from both; money budgets count nanodollars as token budgets count
tokens, the worst case reserved and the actual settled."""

from __future__ import annotations

import asyncio

import pytest

from gateway.db import Database, migrate
from gateway.tenancy.quota import MemoryQuotaStore, QuotaExceeded, QuotaLimits
from gateway.tenancy.quota.postgres import PostgresQuotaStore
from tests.conftest import PG_URL

NOW = 1_800_000_000.0 + 5  # 5 s into a minute


@pytest.fixture(params=["memory", "postgres"])
async def store(request):
    if request.param == "memory":
        yield MemoryQuotaStore()
        return
    schema = request.getfixturevalue("pg_schema")
    db = Database(PG_URL, schema)
    await migrate(db)
    yield PostgresQuotaStore(db)
    await db.close()


async def test_rpm_is_exact_and_refusal_takes_nothing(store):
    limits = QuotaLimits(rpm=3)
    for _ in range(3):
        await store.admit("t", limits, 10, NOW)
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", limits, 10, NOW)
    assert e.value.kind == "requests" and e.value.limit == 3
    assert 54 < e.value.reset_s <= 55
    used = await store.used("t", NOW)
    assert used["requests"] == 3 and used["tokens"] == 30
    await store.admit("t", limits, 10, NOW + 60)  # the next minute starts empty


async def test_tokens_reserved_then_settled(store):
    limits = QuotaLimits(tpm=100)
    res = await store.admit("t", limits, 80, NOW)
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", limits, 30, NOW)
    assert e.value.kind == "tokens" and e.value.used == 80
    await store.settle(res, 20)  # used far less than reserved
    await store.settle(res, 20)  # idempotent
    assert (await store.used("t", NOW))["tokens"] == 20
    await store.admit("t", limits, 80, NOW)


async def test_request_larger_than_the_limit(store):
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", QuotaLimits(tpm=50), 51, NOW)
    assert e.value.kind == "tokens"
    assert (await store.used("t", NOW))["requests"] == 0


async def test_concurrency_slot_freed_by_settle(store):
    limits = QuotaLimits(max_concurrent=1)
    res = await store.admit("t", limits, 1, NOW)
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", limits, 1, NOW)
    assert e.value.kind == "concurrent"
    await store.settle(res, 1, count_request=False)
    assert (await store.used("t", NOW))["requests"] == 0
    await store.admit("t", limits, 1, NOW)


async def test_daily_and_monthly_budgets(store):
    limits = QuotaLimits(daily_tokens=100, monthly_tokens=150)
    await store.admit("t", limits, 100, NOW)
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", limits, 1, NOW)
    assert e.value.kind == "daily"
    await store.admit("t", limits, 50, NOW + 86400)
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", limits, 1, NOW + 86400)
    assert e.value.kind == "monthly"


async def test_tenants_do_not_share_counters(store):
    limits = QuotaLimits(rpm=1)
    await store.admit("a", limits, 1, NOW)
    await store.admit("b", limits, 1, NOW)
    with pytest.raises(QuotaExceeded):
        await store.admit("a", limits, 1, NOW)


async def test_concurrent_admissions_are_exact(store):
    limits = QuotaLimits(rpm=50)

    async def one():
        try:
            await store.admit("t", limits, 1, NOW)
            return True
        except QuotaExceeded:
            return False

    results = await asyncio.gather(*(one() for _ in range(120)))
    assert sum(results) == 50


def keyed(tenant: QuotaLimits, key: QuotaLimits, key_id: str = "key_a") -> QuotaLimits:
    return QuotaLimits.with_key(tenant, key_id, key)


# (limit field, the counter it holds, whether it counts tokens (or spend) rather than
# requests); each admission below takes 10 tokens and 10 nanodollars
LIMITED = [
    ("rpm", "requests", False),
    ("tpm", "tokens", True),
    ("max_concurrent", "concurrent", False),
    ("daily_tokens", "daily", True),
    ("monthly_tokens", "monthly", True),
    ("daily_spend", "daily_spend", True),
    ("monthly_spend", "monthly_spend", True),
]


@pytest.mark.parametrize("stricter", ["key", "tenant"])
@pytest.mark.parametrize(("field", "kind", "counts_tokens"), LIMITED, ids=[f for f, *_ in LIMITED])
async def test_the_stricter_of_key_and_tenant_refuses(store, field, kind, counts_tokens, stricter):
    unit = 10 if counts_tokens else 1  # each admission: 1 request, 10 tokens
    tight, loose = QuotaLimits(**{field: 2 * unit}), QuotaLimits(**{field: 4 * unit})
    tenant, key = (loose, tight) if stricter == "key" else (tight, loose)
    limits = keyed(tenant, key)
    assert limits.limit_for(kind) == 2 * unit  # what token planning and headers see
    for _ in range(2):
        await store.admit("t", limits, 10, NOW, spend=10)
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", limits, 10, NOW, spend=10)
    assert (e.value.kind, e.value.who, e.value.limit, e.value.used) == (
        kind,
        stricter,
        2 * unit,
        2 * unit,
    )
    assert ("this API key's" in str(e.value)) == (stricter == "key")
    for owner in ("t", "key_a"):  # the refusal took nothing from either
        used = await store.used(owner, NOW)
        assert (used["requests"], used["tokens"], used["concurrent"]) == (2, 20, 2), owner
        assert used["daily"] == used["monthly"] == 20
        assert used["daily_spend"] == used["monthly_spend"] == 20


async def test_keys_count_apart_and_share_their_tenants_limit(store):
    tenant = QuotaLimits(rpm=3)
    a, b = keyed(tenant, QuotaLimits(rpm=2)), keyed(tenant, QuotaLimits(rpm=2), "key_b")
    unlimited_key = keyed(tenant, QuotaLimits(), "key_c")
    assert unlimited_key == tenant  # no counters of its own
    await store.admit("t", a, 1, NOW)
    await store.admit("t", a, 1, NOW)
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", a, 1, NOW)
    assert e.value.who == "key"
    await store.admit("t", b, 1, NOW)
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", b, 1, NOW)
    assert e.value.who == "tenant" and e.value.used == 3
    assert (await store.used("key_b", NOW))["requests"] == 1
    assert (await store.used("key_c", NOW))["requests"] == 0


async def test_settle_corrects_the_keys_counters_too(store):
    limits = keyed(QuotaLimits(tpm=1000, rpm=50), QuotaLimits(tpm=100, max_concurrent=1))
    res = await store.admit("t", limits, 80, NOW)
    assert res.remaining == {"requests": 49, "tokens": 20}  # the tightest of both
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", limits, 1, NOW)
    assert (e.value.kind, e.value.who) == ("concurrent", "key")
    await store.settle(res, 15, count_request=False)
    await store.settle(res, 15)  # idempotent
    for owner in ("t", "key_a"):
        used = await store.used(owner, NOW)
        assert (used["requests"], used["tokens"], used["concurrent"]) == (0, 15, 0), owner
    await store.admit("t", limits, 85, NOW)


@pytest.mark.parametrize("stricter", ["key", "tenant"])
async def test_concurrent_admissions_against_a_key_are_exact(store, stricter):
    tight, loose = QuotaLimits(rpm=10), QuotaLimits(rpm=50)
    limits = keyed(loose, tight) if stricter == "key" else keyed(tight, loose)

    async def one():
        try:
            await store.admit("t", limits, 1, NOW)
            return True
        except QuotaExceeded as e:
            assert e.who == stricter
            return False

    results = await asyncio.gather(*(one() for _ in range(100)))
    assert sum(results) == 10
    assert (await store.used("t", NOW))["requests"] == 10
    assert (await store.used("key_a", NOW))["requests"] == 10


async def test_slots_of_a_dead_gateway_are_taken_back(pg_schema):
    db = Database(PG_URL, pg_schema)
    await migrate(db)
    dead, alive = PostgresQuotaStore(db), PostgresQuotaStore(db)
    limits = QuotaLimits(max_concurrent=2)
    await dead.admit("t", limits, 1, NOW)
    await dead.admit("t", limits, 1, NOW)  # then it is killed: never settles
    with pytest.raises(QuotaExceeded) as e:
        await alive.admit("t", limits, 1, NOW + 1)
    assert e.value.kind == "concurrent"
    assert await alive.reclaim_stale(NOW + 10) == 0  # a recent heartbeat is respected
    assert await alive.reclaim_stale(NOW + 600) == 2
    res = await alive.admit("t", limits, 1, NOW + 600)
    await alive.settle(res, 1)
    assert (await alive.used("t", NOW + 600))["concurrent"] == 0
    await db.close()


async def test_a_dead_gateways_slots_of_a_key_are_taken_back(pg_schema):
    db = Database(PG_URL, pg_schema)
    await migrate(db)
    dead, alive = PostgresQuotaStore(db), PostgresQuotaStore(db)
    limits = keyed(QuotaLimits(max_concurrent=5), QuotaLimits(max_concurrent=1))
    await dead.admit("t", limits, 1, NOW)  # then it is killed: never settles
    with pytest.raises(QuotaExceeded) as e:
        await alive.admit("t", limits, 1, NOW + 1)
    assert (e.value.kind, e.value.who) == ("concurrent", "key")
    assert await alive.reclaim_stale(NOW + 600) == 2  # the tenant's slot and the key's
    res = await alive.admit("t", limits, 1, NOW + 600)
    await alive.settle(res, 1)
    assert (await alive.used("key_a", NOW + 600))["concurrent"] == 0
    await db.close()


async def test_spend_reserved_then_settled(store):
    limits = QuotaLimits(daily_spend=1000)
    res = await store.admit("t", limits, 50, NOW, spend=800)  # the worst case
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", limits, 50, NOW, spend=300)
    assert (e.value.kind, e.value.limit, e.value.used, e.value.requested) == (
        "daily_spend",
        1000,
        800,
        300,
    )
    assert "your tenant's spend per day (daily_spend)" in str(e.value)
    assert "limit $0.000001, used $0.0000008, requested at most $0.0000003" in str(e.value)
    assert 0 < e.value.reset_s <= 86400 and e.value.headers()["Retry-After"]
    await store.settle(res, 20, used_spend=120)  # it cost far less than the worst case
    await store.settle(res, 20, used_spend=120)  # idempotent
    used = await store.used("t", NOW)
    assert (used["daily_spend"], used["monthly_spend"], used["daily"]) == (120, 120, 20)
    await store.admit("t", limits, 50, NOW, spend=880)  # exactly to the limit
    with pytest.raises(QuotaExceeded):
        await store.admit("t", limits, 1, NOW, spend=1)


async def test_monthly_spend_spans_the_days_and_a_free_model_passes(store):
    limits = QuotaLimits(daily_spend=100, monthly_spend=150)
    await store.admit("t", limits, 1, NOW, spend=100)
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", limits, 1, NOW, spend=1)
    assert e.value.kind == "daily_spend"
    await store.admit("t", limits, 1, NOW + 86400, spend=50)
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", limits, 1, NOW + 86400, spend=1)
    assert e.value.kind == "monthly_spend"
    # a model with no price costs nothing: money budgets do not hold it, spent or not
    res = await store.admit("t", QuotaLimits(daily_spend=0), 1, NOW + 86400)
    await store.settle(res, 1)
    assert (await store.used("t", NOW + 86400))["monthly_spend"] == 150


async def test_a_spend_larger_than_the_budget(store):
    with pytest.raises(QuotaExceeded) as e:
        await store.admit("t", QuotaLimits(monthly_spend=99), 1, NOW, spend=100)
    assert e.value.kind == "monthly_spend"
    assert (await store.used("t", NOW))["requests"] == 0


@pytest.mark.parametrize("whose", ["tenant", "key"])
async def test_concurrent_spend_is_exact(store, whose):
    """100 admissions at once, each reserving 70 nanodollars, against a budget of 1000:
    exactly 14 fit, whichever scope holds the budget, and settling the actual spend
    (30 each) lets exactly the ones that now fit in."""
    budget, other = QuotaLimits(daily_spend=1000), QuotaLimits(daily_spend=10**9)
    limits = keyed(other, budget) if whose == "key" else keyed(budget, other)
    admitted = []

    async def one():
        try:
            admitted.append(await store.admit("t", limits, 5, NOW, spend=70))
        except QuotaExceeded as e:
            assert (e.kind, e.who) == ("daily_spend", whose)

    await asyncio.gather(*(one() for _ in range(100)))
    assert len(admitted) == 14
    owner = "key_a" if whose == "key" else "t"
    assert (await store.used(owner, NOW))["daily_spend"] == 980
    await asyncio.gather(*(store.settle(r, 5, used_spend=30) for r in admitted))
    assert (await store.used(owner, NOW))["daily_spend"] == 420
    await asyncio.gather(*(one() for _ in range(100)))  # (1000 - 420) // 70 more
    assert len(admitted) == 14 + 8
    assert (await store.used(owner, NOW))["daily_spend"] == 420 + 8 * 70
