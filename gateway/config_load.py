"""Loading the settings: one TOML file (its [server] table, [[backends]] entries and
price tables), then the `KVGATE_*` environment variables, then the command line's flags,
later sources winning, into gateway.config's Settings (which checks the values). Apart
from the table so that it says what each setting is and this where values come from;
ConfigSource keeps how a gateway loaded them, for a reload to load them the same way.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gateway.backends import BackendSpec
from gateway.backends.generation_config import checked
from gateway.backends.spec import parse_lora_modules
from gateway.config import Settings
from gateway.config_backends import with_lora
from gateway.config_check import ConfigError, table, text
from gateway.observe.tracing import trace_export

_ENV_FIELDS = {
    "host": str,
    "port": int,
    "database_url": str,
    "database_schema": str,
    "sqlite_wal_limit_bytes": int,
    "instance": str,
    "admin_key": str,
    "secret": str,
    "kv_tier_secret": str,
    "max_body_bytes": int,
    "key_cache_ttl_s": float,
    "metrics_auth": lambda v: v.lower() in ("1", "true", "yes"),
    "metrics_token": str,
    "otlp_traces_endpoint": str,
    "max_connections": int,
    "header_timeout_s": float,
    "body_timeout_s": float,
    "keepalive_timeout_s": float,
    "drain_timeout_s": float,
    "max_pins_per_tenant": int,
    "max_pin_tokens_per_tenant": int,
    "backend": str,
    "model": str,
    "served_model_name": str,
    "replicas": int,
    "workers": int,
    "router_policy": str,
    "prefill_workers": int,
    "prefill_threshold": int,
    "prefill_timeout_s": float,
    "quantization": str,
    "kv_cache_dtype": str,
    "max_model_len": int,
    "max_num_seqs": int,
    "gpu_memory_utilization": float,
    "tensor_parallel_size": int,
    "enable_expert_parallel": lambda v: v.lower() in ("1", "true", "yes"),
    "pipeline_parallel_size": int,
    "kv_offload_gb": float,
    "kv_disk_path": str,
    "kv_disk_gb": float,
    "kv_shared_url": str,
    "n_ctx": int,
    "n_parallel": int,
    "n_threads": int,
    "enable_lora": lambda v: v.lower() in ("1", "true", "yes"),
    "max_loras": int,
    "max_lora_rank": int,
    "max_cpu_loras": int,
    "lora_modules": lambda v: v.split(),
    "fairness": str,
    "reasoning_parser": str,
    "tool_call_parser": str,
    "files_dir": str,
    "max_file_bytes": int,
    "max_file_lines": int,
    "batch_in_flight": int,
    "max_image_bytes": int,
    "max_image_pixels": int,
    "max_images_per_request": int,
    "allowed_image_hosts": lambda v: v.replace(",", " ").split(),
    "image_fetch_timeout_s": float,
    "models_dir": str,
    "models_max": int,
    "models_memory_gb": float,
    "keep_alive": str,
}


@dataclass(frozen=True)
class ConfigSource:
    """Where a gateway's settings came from, so that a reload (SIGHUP, POST
    /admin/reload) reads them the same way: the config file again, under the same
    KVGATE_* variables and command-line flags."""

    config_file: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    def load(self) -> Settings:
        settings = load_settings(self.config_file, self.overrides, require_backends=True)
        settings.resolved_backends()  # a setting the chosen backend lacks is an error here
        return settings


# what names the backends to serve; a config file with none of them serves nothing
BACKEND_CHOICES = frozenset({"backends", "backend", "model", "served_model_name", "models_dir"})


def load_settings(
    config_file: str | os.PathLike | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    require_backends: bool = False,
) -> Settings:
    """The settings, later sources winning; ConfigError (a ValueError) naming the key
    that does not validate. `require_backends` (a gateway's, at start and on a reload):
    a config file must name what it serves (a [[backends]] entry, or `backend`, `model`
    by any source): one with none (its entries deleted, say) must not quietly serve the
    default model in their place."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    config_file = config_file or environ.get("KVGATE_CONFIG")
    if config_file:
        values.update(_read_toml(Path(config_file)))
    for name, cast in _ENV_FIELDS.items():
        env_name = "KVGATE_" + name.upper()
        if environ.get(env_name):
            try:
                values[name] = cast(environ[env_name])
            except ValueError:
                raise ConfigError(name, f"{env_name} is not valid: {environ[env_name]!r}") from None
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
    known = {f.name for f in fields(Settings)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(min(unknown), f"unknown settings: {sorted(unknown)}")
    if require_backends and config_file and not BACKEND_CHOICES & set(values):
        raise ConfigError(
            "backends",
            f"{config_file} has no [[backends]] entry: add one, or ask for the default model "
            'with backend = "auto" in [server] (or KVGATE_BACKEND, --backend)',
        )
    settings = Settings(**values)
    # an OTEL_* trace export kvgate cannot send is a configuration error, found here
    trace_export(settings.otlp_traces_endpoint, "kvgate", environ)
    return settings


def _read_toml(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        data = tomllib.load(f)
    values: dict[str, Any] = dict(table(data.get("server", {}), "server"))
    entries = data.get("backends", [])
    if not isinstance(entries, list):
        raise ConfigError("backends", f"backends must be [[backends]] tables, got {entries!r}")
    specs = [_backend_entry(path, i, entry) for i, entry in enumerate(entries)]
    if specs:
        values["backends"] = specs
        values.setdefault("backend", "")
    if "prices" in data:
        values["prices"] = table(data["prices"], "prices")  # each model's: by Settings
    if "batch_prices" in data:
        values["batch_prices"] = table(data["batch_prices"], "batch_prices")
    return values


def _backend_entry(path: Path, i: int, entry: Any) -> BackendSpec:
    """One [[backends]] table as a BackendSpec, each field of its type."""
    entry = dict(table(entry, f"backends[{i}]"))
    for needed in ("name", "type"):
        if needed not in entry:
            raise ConfigError(f"backends[{i}]", f"{path}: each [[backends]] entry needs {needed!r}")
    name = text(entry.pop("name"), f"backends[{i}].name", required=True)
    key = f"backends.{name}"
    kind = text(entry.pop("type"), f"{key}.type", required=True)
    model = text(entry.pop("model", ""), f"{key}.model")
    served = text(entry.pop("served_model_name", ""), f"{key}.served_model_name")
    options = table(entry.pop("options", {}), f"{key}.options") | entry
    modules = parse_lora_modules(options.pop("lora_modules", []), f"{path}: backend {name!r}")
    parsers = {
        field: text(options.pop(field), f"{key}.{field}") or None
        for field in ("reasoning_parser", "tool_call_parser")
        if field in options
    }
    generation = table(options.pop("generation_config", {}), f"{key}.generation_config")
    try:
        overrides = checked(generation, f"{key}.generation_config")
    except ValueError as e:
        raise ConfigError(f"{key}.generation_config", str(e)) from None
    spec = BackendSpec(name, kind, model, served, options, **parsers, generation_config=overrides)
    return with_lora(spec, modules)
