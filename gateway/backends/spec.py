"""One `[[backends]]` entry of the config, as the adapters and the settings read it.
Apart from the package's builders so that an adapter can name its spec without
importing the registry that imports the adapters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoraModule:
    """A public LoRA adapter the config serves over an entry's model (vLLM's
    --lora-modules): its name, its path (for a third-party upstream: the upstream's name
    of it) and, where given, the base model's id (vLLM's base_model_name)."""

    name: str
    path: str
    base_model: str = ""


@dataclass
class BackendSpec:
    """One `[[backends]]` entry of the config.

    name: unique name of this backend instance; type: fake | gpu | local | remote;
    model: a path (GGUF file, HF directory) or "" for the backend's default;
    served_model_name: the model id clients ask for ("" derives one from model);
    options: type-specific settings (engine arguments, fake timings...);
    lora_modules: public LoRA adapters over its model (the gateway registers them);
    reasoning_parser, tool_call_parser: the output parsers of its replies (gateway.parsers'
    names; None: detected from the model, gateway.serving.parser_choice);
    generation_config: sampling defaults over the model's own (vLLM's
    --override-generation-config; gateway.backends.generation_config).
    """

    name: str
    type: str
    model: str = ""
    served_model_name: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    lora_modules: list[LoraModule] = field(default_factory=list)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    generation_config: dict[str, float] = field(default_factory=dict)


def replica_count(spec: BackendSpec) -> int:
    """The entry's option `replicas` (default 1), or ValueError."""
    n = spec.options.get("replicas", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"backend {spec.name!r}: replicas must be an integer >= 1, got {n!r}")
    return n


def parse_lora_modules(values: Any, where: str) -> list[LoraModule]:
    """vLLM's --lora-modules forms: "NAME=PATH", a JSON object {"name", "path",
    "base_model_name"} (a string, or a TOML table); ValueError naming `where` else."""
    if not isinstance(values, list):
        raise ValueError(f"{where}: lora_modules must be a list, got {values!r}")
    return [_lora_module(v, where) for v in values]


def _lora_module(value: Any, where: str) -> LoraModule:
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{where}: lora module {value!r} is not valid JSON") from None
    if isinstance(value, str):
        name, sep, path = value.partition("=")
        if sep and name and path:
            return LoraModule(name, path)
    elif isinstance(value, dict) and not set(value) - {"name", "path", "base_model_name"}:
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name", "")
        if isinstance(name, str) and name and isinstance(path, str) and path:
            return LoraModule(name, path, str(base or ""))
    raise ValueError(
        f"{where}: lora module {value!r} must be NAME=PATH or "
        '{"name": ..., "path": ..., "base_model_name": ...}'
    )
