"""The base of every request body at the HTTP boundary: strict types, unknown fields
refused by name (gateway.schemas.inference, gateway.schemas.structured)."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

# PostgreSQL cannot store NUL; a name prints on one line: no C0, DEL or C1 characters
NO_CONTROL = r"^[^\x00-\x1f\x7f-\x9f]*$"
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Refused(ValueError):
    """A validator's refusal of one place inside the value it checks (`at`: an item's
    index, a field's name), so that the 400 names that place's path (gateway.http.validation
    reads `at`): `raise Refused("tools of type 'web' are not supported", 2, "type")` in a
    validator of `tools` is about tools[2].type. A ValueError, as pydantic takes one."""

    def __init__(self, reason: str, *at: str | int) -> None:
        super().__init__(reason)
        self.at = at


class StrictBody(BaseModel):
    """Strict, and refusing unknown fields by name. A field sent as null asks for nothing,
    so it is dropped rather than refused (some clients send every field, null or not)."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = _known_names(cls)
        unknown = [k for k in data if k not in known and data[k] is not None]
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise ValueError(f"Unrecognized request argument supplied: {names}")
        return {k: v for k, v in data.items() if k in known}


@functools.cache
def _known_names(model: type[BaseModel]) -> frozenset[str]:
    """The names a body of `model` may use, made once per model, not once per body: a
    field may be known by its alias ("schema", "json" would shadow BaseModel's)."""
    return frozenset(f.alias or name for name, f in model.model_fields.items())
