"""What the engine adapters (gpu, local) share: option checks, model ids, sampling."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterable
from typing import Any

from gateway.backends import BackendSpec
from gateway.backends.base import BadRequestError, SamplingOptions
from gateway.default_model import DEFAULT_MODEL_ID


def check_options(spec: BackendSpec, allowed: Iterable[str]) -> None:
    unknown = set(spec.options) - set(allowed)
    if unknown:
        raise ValueError(
            f"unknown options for {spec.type} backend {spec.name!r}: {sorted(unknown)}; "
            f"expected some of {sorted(allowed)}"
        )


def served_model_id(spec: BackendSpec) -> str:
    """The id clients ask for: as configured, else the file or directory name."""
    if spec.served_model_name:
        return spec.served_model_name
    if spec.model:
        return pathlib.Path(spec.model.rstrip("/")).stem
    return DEFAULT_MODEL_ID


def check_model(model: str, served: str) -> None:
    if model != served:
        raise BadRequestError(f"model {model!r} is not served here (this serves {served!r})")


def sampling_kwargs(options: SamplingOptions) -> dict[str, Any]:
    """The gateway's sampling options as keyword arguments: both engines' SamplingParams
    take the same names."""
    return dataclasses.asdict(options)
