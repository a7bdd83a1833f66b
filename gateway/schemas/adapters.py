"""Bodies of the LoRA adapter routes: an admin's registration (POST /admin/adapters,
`kvgate adapters add`) and the gateway's check on a worker (POST /kvgate/v1/adapters/check).
Apart from the admin bodies: one API's bodies to a file."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gateway.schemas.base import StrictBody
from gateway.schemas.fields import Name

# a model id clients send: no '/' (a route's path segment) and nothing a shell or a
# header would mangle
AdapterName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")]
AdapterPath = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]


class AdapterCheck(StrictBody):
    name: AdapterName
    path: AdapterPath


class AdapterCreate(AdapterCheck):
    base_model: Name
    tenant: Name | None = None  # a tenant's id or name; None: every tenant may use it
