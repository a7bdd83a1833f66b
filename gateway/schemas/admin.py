"""Bodies of the routes that manage rather than run a model: tenants and API keys with
their limits (the admin API and `kvgate admin`), and pinned prefixes (a tenant's own,
POST /v1/prefixes, or an admin's).

They share only the bounded field types (gateway.schemas.fields) and the strict base
with the inference bodies (gateway.schemas.inference), and other modules read them (admin_api,
cli_admin, prefix_api, openapi): apart, each file holds one API's bodies.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, create_model

from gateway.schemas.base import NO_CONTROL
from gateway.schemas.base import StrictBody as _Body
from gateway.schemas.fields import Count32, Count53, Name, Priority
from gateway.tenancy.quota.limits import COUNT32, COUNT53, LIMITS, MODELS, USD

# PostgreSQL cannot store NUL (NO_CONTROL, for names, is gateway.schemas.base's)
NO_NUL = r"^[^\x00]*$"  # pin text may hold newlines and tabs, not NUL
MAX_PIN_CHARS = 200_000  # past this it cannot fit any context window we serve
PIN_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"

Weight = Annotated[float, Field(gt=0, le=1e6)]
Models = Annotated[list[Name], Field(max_length=1000)]


# a money budget in USD; stored in nanodollars, so at most what 64 bits hold
Dollars = Annotated[float, Field(ge=0, le=1e9)]


# what each limit holds (gateway.tenancy.quota.limits) as a request bounds it
_BOUNDED: dict[str, Any] = {COUNT32: Count32, COUNT53: Count53, USD: Dollars, MODELS: Models}

Limits = create_model(
    "Limits",
    __base__=_Body,
    __module__=__name__,
    __doc__="""The limits a tenant and an API key may each have (null or left out: none); a
    key's hold beside its tenant's, the stricter one winning, and its models narrow the
    tenant's. Built from gateway.tenancy.quota.limits.LIMITS, the one list of them.""",
    **{f.name: (_BOUNDED[f.holds] | None, None) for f in LIMITS},
)


class TenantCreate(Limits):
    name: Name
    priority: Priority = 0
    weight: Weight = 1.0


class TenantUpdate(Limits):
    name: Name | None = None
    priority: Priority | None = None
    weight: Weight | None = None


KeyName = Annotated[str, Field(max_length=200, pattern=NO_CONTROL)]


class KeyCreate(Limits):
    name: KeyName = ""
    scopes: Annotated[list[Literal["inference", "admin"]], Field(min_length=1, max_length=2)] = [
        "inference"
    ]
    expires_at: Annotated[float, Field(ge=0, le=1e11)] | None = None
    expires_in_s: Annotated[float, Field(gt=0, le=1e10)] | None = None
    # the key's default priority (lower first; null: its tenant's); it only yields
    priority: Priority | None = None


class KeyUpdate(Limits):
    """Fields sent replace the old ones; a limit sent as null is lifted."""

    name: KeyName | None = None
    priority: Priority | None = None


class PinCreate(_Body):
    """A tenant's own pinned system prompt (POST /v1/prefixes)."""

    name: Annotated[str, Field(pattern=PIN_NAME)]
    text: Annotated[str, Field(min_length=1, max_length=MAX_PIN_CHARS, pattern=NO_NUL)]
    model: Name | None = None


class AdminPinCreate(PinCreate):
    """An admin's pin for a tenant, or a published prefix (tenant null, shared true)."""

    tenant: Annotated[str, Field(min_length=1, max_length=32, pattern=NO_CONTROL)] | None
    shared: bool | None = None  # default: shared exactly when there is no tenant
