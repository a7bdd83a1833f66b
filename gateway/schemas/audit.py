"""The query of GET /admin/audit (and `kvgate audit`'s flags, checked the same way).

Query parameters arrive as text, so this model converts (a limit of "50" is 50) where the
bodies' models are strict; anything it does not know is refused by name all the same.
`since` and `until` take UNIX seconds or an ISO 8601 date or time (UTC unless it says).
"""

from __future__ import annotations

import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.schemas.base import NO_CONTROL
from gateway.tenancy.audit import MAX_PAGE, AuditFilter

Text = Annotated[str, Field(min_length=1, max_length=200, pattern=NO_CONTROL)]
MAX_ID = 2**63 - 1  # a row id is a signed 64-bit integer in both databases


class AuditQuery(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    action: Text | None = None
    target: Text | None = None
    tenant_id: Text | None = None
    since: datetime.datetime | None = None
    until: datetime.datetime | None = None
    limit: Annotated[int, Field(ge=1, le=MAX_PAGE)] = 100
    cursor: Annotated[int, Field(ge=1, le=MAX_ID)] | None = None

    @field_validator("since", "until")
    @classmethod
    def _utc(cls, value: datetime.datetime | None) -> datetime.datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=datetime.UTC)
        return value

    def filter(self) -> AuditFilter:
        return AuditFilter(
            action=self.action,
            target=self.target,
            tenant_id=self.tenant_id,
            since=self.since.timestamp() if self.since else None,
            until=self.until.timestamp() if self.until else None,
            limit=self.limit,
            cursor=self.cursor,
        )
