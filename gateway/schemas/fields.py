"""The bounded value types request bodies are built from, shared by the inference bodies
(gateway.schemas.inference), the management bodies (gateway.schemas.admin) and the worker's
(gateway.worker.schemas).

Every value is bounded by what the server can hold: a string that lands in a column fits
it and holds no control character, an integer fits its column. Kept apart so that each
body module says only which fields it has, and one bound has one definition.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from gateway.schemas.base import NO_CONTROL

INT32 = 2**31 - 1
INT53 = 2**53 - 1  # the largest integer every JSON client holds exactly


def _whole_number(v: Any) -> Any:
    """7.0 is an integer to JSON Schema (and to /openapi.json): take it as 7. Strings,
    booleans and 7.5 still fail the strict int check."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Int = Annotated[int, BeforeValidator(_whole_number)]

Name = Annotated[str, Field(min_length=1, max_length=200, pattern=NO_CONTROL)]
Count32 = Annotated[Int, Field(ge=0, le=INT32)]
Count53 = Annotated[Int, Field(ge=0, le=INT53)]
Priority = Annotated[Int, Field(ge=-INT32, le=INT32)]
