"""The bounded value types request bodies are built from, shared by the inference bodies
(gateway.schemas.inference), the management bodies (gateway.schemas.admin) and the worker's
(gateway.worker.schemas).

Every value is bounded by what the server can hold: a string that lands in a column fits
it and holds no control character, an integer fits its column. Kept apart so that each
body module says only which fields it has, and one bound has one definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema

from gateway.schemas.base import NO_CONTROL

INT32 = 2**31 - 1
INT53 = 2**53 - 1  # the largest integer every JSON client holds exactly


def _whole_number(v: Any) -> Any:
    """7.0 is an integer to JSON Schema (and to /openapi.json): take it as 7. Strings,
    booleans and 7.5 still fail the strict int check."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


@dataclass(frozen=True)
class IntIn:
    """An integer from `ge` to `le` (None: unbounded), 7.0 taken as 7:
    `Annotated[int, IntIn(0, INT32)]`.

    The bounds are the integer schema's own, checked inside the conversion. A bound written
    outside it (`Annotated[Int, Field(ge=0)]`) cannot reach that schema: pydantic wraps it
    in a validator function of its own, whose repr (functools.partial, a memory address)
    it then writes into the location of every error of a union holding the field."""

    ge: int | None = None
    le: int | None = None

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_before_validator_function(
            _whole_number, core_schema.int_schema(ge=self.ge, le=self.le)
        )


Name = Annotated[str, Field(min_length=1, max_length=200, pattern=NO_CONTROL)]
Count32 = Annotated[int, IntIn(0, INT32)]
Count53 = Annotated[int, IntIn(0, INT53)]
Priority = Annotated[int, IntIn(-INT32, INT32)]
TokenId = Annotated[int, IntIn(0, INT32)]
