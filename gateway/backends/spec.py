"""One `[[backends]]` entry of the config, as the adapters and the settings read it.
Apart from the package's builders so that an adapter can name its spec without
importing the registry that imports the adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BackendSpec:
    """One `[[backends]]` entry of the config.

    name: unique name of this backend instance; type: fake | gpu | local | remote;
    model: a path (GGUF file, HF directory) or "" for the backend's default;
    served_model_name: the model id clients ask for ("" derives one from model);
    options: type-specific settings (engine arguments, fake timings...).
    """

    name: str
    type: str
    model: str = ""
    served_model_name: str = ""
    options: dict[str, Any] = field(default_factory=dict)


def replica_count(spec: BackendSpec) -> int:
    """The entry's option `replicas` (default 1), or ValueError."""
    n = spec.options.get("replicas", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"backend {spec.name!r}: replicas must be an integer >= 1, got {n!r}")
    return n
