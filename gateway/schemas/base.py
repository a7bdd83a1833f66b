"""The base of every request body at the HTTP boundary: strict types, unknown fields
refused by name (gateway.schemas.inference, gateway.schemas.structured)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

# PostgreSQL cannot store NUL; a name prints on one line: no C0, DEL or C1 characters
NO_CONTROL = r"^[^\x00-\x1f\x7f-\x9f]*$"
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StrictBody(BaseModel):
    """Strict, and refusing unknown fields by name. A field sent as null asks for nothing,
    so it is dropped rather than refused (some clients send every field, null or not)."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # a field may be known by its alias ("schema", "json" would shadow BaseModel's)
        known = {f.alias or name for name, f in cls.model_fields.items()}
        unknown = [k for k in data if k not in known and data[k] is not None]
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise ValueError(f"Unrecognized request argument supplied: {names}")
        return {k: v for k, v in data.items() if k in known}
