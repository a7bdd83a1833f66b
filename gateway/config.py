"""Settings from one TOML file, `KVGATE_*` environment variables and CLI flags
(later sources win)."""

from __future__ import annotations

import os
import re
import socket
import tomllib
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from gateway.backends import BackendSpec, replica_count
from gateway.backends.default_model import starter_backends
from gateway.backends.generation_config import checked
from gateway.backends.spec import LoraModule, parse_lora_modules
from gateway.config_check import (
    ConfigError,
    check_parsers,
    check_types,
    keep_alive_s,
    table,
    text,
)
from gateway.db.engine import SQLITE_WAL_LIMIT_BYTES
from gateway.observe.tracing import trace_export
from gateway.tenancy.quota.prices import FREE, Price, parse_prices

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///kvgate.db"
MAX_BODY_BYTES = 4 * 1024 * 1024
ROUTER_POLICIES = ("prefix", "round_robin", "least_loaded")  # gateway.routing.router
MIN_ADMIN_KEY_CHARS = 32  # a configured admin key must be as hard to guess as a generated one
MAX_DRAIN_TIMEOUT_S = 3600.0  # a drain past an hour is a hung process, not a drain
MAX_INSTANCE_CHARS = 100  # catalog rows are keyed "<instance>/<replica>", 200 characters in all
MAX_IMAGE_FETCH_TIMEOUT_S = 300.0
_HOST = re.compile(r"[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?)*")


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    database_url: str = DEFAULT_DATABASE_URL
    database_schema: str | None = None
    # SQLite: the write-ahead log's size past which the usage writer starts it again
    sqlite_wal_limit_bytes: int = SQLITE_WAL_LIMIT_BYTES
    # names this gateway's prefix-catalog rows, so gateways sharing one database keep
    # theirs apart; it must stay the same across restarts. "": "<hostname>:<port>"
    instance: str = ""
    admin_key: str | None = None
    secret: str | None = None  # HMAC secret for cache salts; generated and stored when unset
    # the key of the MAC on the KV blocks the engines store (disk, Redis) or move between
    # workers; unset: the one generated into the database, shared by its gateways
    kv_tier_secret: str | None = field(default=None, repr=False)
    max_body_bytes: int = MAX_BODY_BYTES  # also the limit on a decompressed body
    key_cache_ttl_s: float = 5.0
    # /metrics names tenants: it needs the admin key, or `metrics_token` for a scraper
    metrics_auth: bool = True
    metrics_token: str | None = None
    # OpenTelemetry traces to this OTLP endpoint (vLLM's --otlp-traces-endpoint); unset,
    # the standard OTEL_EXPORTER_OTLP_* variables decide (gateway/observe/tracing.py)
    otlp_traces_endpoint: str | None = None
    # slow or idle clients must not hold connections: caps on time and on their number
    max_connections: int = 4096
    header_timeout_s: float = 10.0  # from connect (or the last response) to full headers
    body_timeout_s: float = 30.0  # to read a request body
    keepalive_timeout_s: float = 15.0
    # SIGTERM/SIGINT: how long the requests in flight may take to finish before the
    # streams still open are cut (gateway/http/drain.py); a reload's removed backends too
    drain_timeout_s: float = 30.0
    # pinned prefixes cost KV memory on every replica: a cap per tenant
    max_pins_per_tenant: int = 32
    max_pin_tokens_per_tenant: int = 65_536
    # "auto" picks gpu with CUDA, else local (llama.cpp), else fake; "" uses [[backends]].
    backend: str = "auto"
    model: str = ""
    served_model_name: str = ""
    backends: list[BackendSpec] = field(default_factory=list)
    replicas: int = 1  # engine replicas of the one --backend/--model (else per [[backends]])
    workers: int = 0  # >0: each engine runs as this many `kvgate worker` processes
    router_policy: str = "prefix"  # or "round_robin", "least_loaded"
    # prefill and decode apart (serving/prefill_apart.py): of the `workers`, this many
    # prefill long prompts for the rest; a prompt of at least `prefill_threshold` tokens
    # goes to a prefill replica first, if one is healthy, for at most `prefill_timeout_s`
    prefill_workers: int = 0
    prefill_threshold: int = 512
    prefill_timeout_s: float = 30.0
    # engine settings of the one --backend (a [[backends]] entry has them in its options);
    # None: the engine's default. Each belongs to the backend types ENGINE_SETTINGS says.
    quantization: str | None = None  # gpu backend: "fp8" or "int8" weights
    kv_cache_dtype: str | None = None  # gpu backend: "auto" or "fp8"
    max_model_len: int | None = None  # gpu backend: tokens per sequence (default: the model's)
    max_num_seqs: int | None = None  # gpu backend: sequences scheduled together (default 256)
    gpu_memory_utilization: float | None = None  # gpu backend: share of GPU memory (0.9)
    device: str | None = None  # gpu backend: "auto" (default: CUDA if there), "cuda", "cpu"
    dtype: str | None = None  # gpu backend: "auto" (bfloat16 on CUDA, float32 on the CPU)
    tensor_parallel_size: int | None = None  # gpu backend: ranks the model is split over (1)
    # gpu backend: a mixture of experts' ranks hold whole experts, not slices (false)
    enable_expert_parallel: bool | None = None
    pipeline_parallel_size: int | None = None  # gpu backend: stages the layers split into (1)
    # gpu backend: tiers under the KV cache (GiB of host memory; a directory and its GiB,
    # which the local backend takes too; a redis:// store shared by engines of one model)
    kv_offload_gb: float | None = None
    kv_disk_path: str | None = None
    kv_disk_gb: float | None = None
    kv_shared_url: str | None = None
    n_ctx: int | None = None  # local backend: KV cells shared by all sequences (16384)
    n_parallel: int | None = None  # local backend: sequences decoded together (4)
    n_threads: int | None = None  # local backend: CPU threads (default: one per core, <= 8)
    # LoRA adapters (vLLM's names): served at all (any adapter given implies it), resident
    # on the device at once, the largest rank, kept in host memory (gpu; local: the first two)
    enable_lora: bool | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    # public adapters over the one --backend's model: "NAME=PATH" or vLLM's JSON form
    # (a [[backends]] entry has its own `lora_modules`)
    lora_modules: list[str] = field(default_factory=list)
    # how tenants share a backend: "vtc" (the Virtual Token Counter: the gpu engine's
    # scheduler, and the gateway's queue before other backends) or "fcfs"; None: vtc
    fairness: str | None = None
    # the output parsers (gateway.parsers' names) of every entry that names none of its
    # own; unset: detected from each model's chat template and config
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # per served model name, from the config's [prices."model"] tables (USD per million
    # tokens); a model with none costs 0 and no money budget holds it
    prices: dict[str, Price] = field(default_factory=dict)
    # the Files and Batch APIs (gateway/batches): the files' directory ("": kvgate-files
    # beside a SQLite database, else in the working directory), an input file's bounds,
    # the batch lines in flight at once, and [batch_prices."model"] as [prices."model"]
    # (a model with none: half its price)
    files_dir: str = ""
    max_file_bytes: int = 100 * 1024 * 1024
    max_file_lines: int = 50_000
    batch_in_flight: int = 4
    batch_prices: dict[str, Price] = field(default_factory=dict)
    # a models directory (gateway/ondemand): every .gguf in it served by its file's stem,
    # listed at once and loaded on first use; at most `models_max` resident (the least
    # recently used unloaded first) within `models_memory_gb` (None: 80% of the memory);
    # a model unused for `keep_alive` (Ollama's: "5m", seconds, negative: never) unloads
    models_dir: str = ""
    models_max: int = 3
    models_memory_gb: float | None = None
    keep_alive: str = "5m"
    # images in chat requests (gateway/serving/images.py): each one's bytes as sent or
    # fetched, its pixels (checked before it is decoded), images per request; remote
    # image URLs are fetched only from `allowed_image_hosts` (never a private, loopback
    # or link-local address; no redirects), within `image_fetch_timeout_s`
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 8
    allowed_image_hosts: list[str] = field(default_factory=list)
    image_fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check_types(self, SETTING_TYPES, skip=frozenset({"prices", "batch_prices"}))
        self.prices = parse_prices(table(self.prices, "prices"))
        self.batch_prices = parse_prices(table(self.batch_prices, "batch_prices"))
        self.instance = self.instance or f"{socket.gethostname()}:{self.port}"
        if "/" in self.instance or len(self.instance) > MAX_INSTANCE_CHARS:
            raise ValueError(
                f"instance must be at most {MAX_INSTANCE_CHARS} characters without '/', "
                f"got {self.instance!r} (set KVGATE_INSTANCE)"
            )
        if self.admin_key is not None and len(self.admin_key) < MIN_ADMIN_KEY_CHARS:
            raise ValueError(
                f"admin_key must be at least {MIN_ADMIN_KEY_CHARS} characters; "
                "leave it unset to have a strong one generated and printed once"
            )
        if self.metrics_token is not None and len(self.metrics_token) < MIN_ADMIN_KEY_CHARS:
            raise ValueError(f"metrics_token must be at least {MIN_ADMIN_KEY_CHARS} characters")
        if self.kv_tier_secret is not None and len(self.kv_tier_secret) < MIN_ADMIN_KEY_CHARS:
            raise ValueError(
                f"kv_tier_secret must be at least {MIN_ADMIN_KEY_CHARS} characters; leave it "
                "unset to have one generated into the database"
            )
        if self.fairness not in (None, "vtc", "fcfs"):
            raise ValueError(f"fairness must be vtc or fcfs, got {self.fairness!r}")
        if not 0 <= self.drain_timeout_s <= MAX_DRAIN_TIMEOUT_S:
            raise ValueError(
                f"drain_timeout_s must be in [0, {MAX_DRAIN_TIMEOUT_S}], got {self.drain_timeout_s}"
            )
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.models_max < 1:
            raise ConfigError("models_max", f"models_max must be >= 1, got {self.models_max}")
        if self.models_memory_gb is not None and not self.models_memory_gb > 0:
            raise ConfigError("models_memory_gb", "models_memory_gb must be > 0")
        try:
            keep_alive_s(self.keep_alive)
        except ValueError as e:
            raise ConfigError("keep_alive", str(e)) from None
        self._check_images()
        if min(self.max_file_bytes, self.max_file_lines, self.batch_in_flight) < 1:
            raise ValueError("max_file_bytes, max_file_lines and batch_in_flight must be >= 1")
        if self.prefill_workers and not 0 < self.prefill_workers < self.workers:
            raise ValueError(
                f"prefill_workers must be fewer than workers, and >= 0 (the other workers "
                f"decode): got {self.prefill_workers} of {self.workers}"
            )
        if self.prefill_threshold < 1 or self.prefill_timeout_s <= 0:
            raise ValueError("prefill_threshold must be >= 1 and prefill_timeout_s > 0")
        check_parsers(self.reasoning_parser, self.tool_call_parser, "")
        for spec in self.backends:
            replica_count(spec)  # a bad `replicas` is a configuration error, found here
            check_parsers(spec.reasoning_parser, spec.tool_call_parser, f"backend {spec.name!r}: ")
            check_no_kv_tier_secret(spec.options, f"backend {spec.name!r}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router_policy must be one of {ROUTER_POLICIES}, got {self.router_policy!r}"
            )

    def _check_images(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.image_fetch_timeout_s <= MAX_IMAGE_FETCH_TIMEOUT_S:
            raise ConfigError(
                "image_fetch_timeout_s",
                f"image_fetch_timeout_s must be in (0, {MAX_IMAGE_FETCH_TIMEOUT_S}]",
            )
        hosts = [h.strip().lower().rstrip(".") for h in self.allowed_image_hosts]
        for host in hosts:
            if not _HOST.fullmatch(host):
                raise ConfigError(
                    "allowed_image_hosts",
                    f"allowed_image_hosts: {host[:100]!r} is not a host name (no scheme, "
                    "port or path: `images.example.com`)",
                )
        self.allowed_image_hosts = hosts

    def price_of(self, model: str) -> Price:
        """The model's prices; one with none is free (FREE)."""
        return self.prices.get(model, FREE)

    def resolved_backends(self, starter: bool = False) -> list[BackendSpec]:
        """The entries to serve, each with the output parsers it names or the settings'.
        `starter` as for _entries."""
        return [
            replace(
                spec,
                reasoning_parser=spec.reasoning_parser or self.reasoning_parser,
                tool_call_parser=spec.tool_call_parser or self.tool_call_parser,
            )
            for spec in self._entries(starter)
        ]

    def _entries(self, starter: bool) -> list[BackendSpec]:
        """The entries to serve. `starter` (kvgate serve's own): with nothing naming a
        backend, model or engine setting, the starter set of default_model, whose first
        model chats; else one entry: the model given, or Gemma 3 270M (a worker's case)."""
        engine_options = {
            name: value for name in ENGINE_SETTINGS if (value := getattr(self, name)) is not None
        }
        if self.models_dir and not (self.backends or self.model) and self.backend in ("", "auto"):
            return []  # the directory's models only (gateway/ondemand), with the engine settings
        if self.backends and not self.model and self.backend in ("", "auto"):
            if self.replicas != 1:  # it would be ignored: one count for which entry?
                engine_options["replicas"] = self.replicas
            if self.lora_modules:
                engine_options["lora_modules"] = self.lora_modules
            if engine_options:
                raise ValueError(
                    f"{sorted(engine_options)} with [[backends]]: set them in an entry's options"
                )
            if self.fairness is None:
                return self.backends
            # --fairness reaches every gpu entry's scheduler that does not choose its own
            return [
                replace(spec, options={"fairness": self.fairness} | spec.options)
                if spec.type == "gpu"
                else spec
                for spec in self.backends
            ]
        kind = pick_backend_type() if self.backend in ("", "auto") else self.backend
        if starter and kind in ("gpu", "local") and self._bare(engine_options):
            return starter_backends(kind, self.fairness)
        _check_engine_settings(engine_options, kind)
        options = {"replicas": self.replicas} if self.replicas != 1 else {}
        options |= engine_options
        if self.fairness is not None and kind == "gpu":  # the engine's own scheduler
            options["fairness"] = self.fairness
        spec = BackendSpec(kind, kind, self.model, self.served_model_name, options)
        return [with_lora(spec, parse_lora_modules(self.lora_modules, "--lora-modules"))]

    def _bare(self, engine_options: dict[str, Any]) -> bool:
        """No backend, model, entry or engine setting given: `make serve` as it comes."""
        given = self.model or self.served_model_name or self.backends or engine_options
        return (
            self.backend == "auto"
            and not given
            and self.replicas == 1
            and not (self.lora_modules or self.workers)
        )

    def dir_options(self, kind: str) -> dict[str, Any]:
        """The engine settings given that backend `kind` takes, as the options of a models
        directory's entries of that kind (each setting applies to the models it fits)."""
        return {
            n: v
            for n, kinds in ENGINE_SETTINGS.items()
            if kind in kinds and (v := getattr(self, n)) is not None
        }


SETTING_TYPES = typing.get_type_hints(Settings)


def with_lora(spec: BackendSpec, modules: list[LoraModule]) -> BackendSpec:
    """The spec serving `modules`: an engine given adapters has LoRA enabled."""
    options = spec.options
    if modules and spec.type in ("gpu", "local"):
        options = {"enable_lora": True} | options
    return replace(spec, options=options, lora_modules=modules)


def check_no_kv_tier_secret(options: dict[str, Any], where: str) -> None:
    """The KV tiers' secret is one for all engines, and kept off command lines: never
    an engine option."""
    if "kv_tier_secret" in options:
        raise ValueError(
            f"{where}: kv_tier_secret is not an engine option; set it once in [server] "
            "(or KVGATE_KV_TIER_SECRET)"
        )


def with_kv_tier_secret(spec: BackendSpec, secret: str | None) -> BackendSpec:
    """The spec of an in-process engine (gpu, local) given the KV tiers' secret."""
    if secret is None or spec.type not in KV_TIER_ENGINES:
        return spec
    return replace(spec, options=spec.options | {"kv_tier_secret": secret})


KV_TIER_ENGINES = ("gpu", "local")  # the engines that store KV blocks below their caches

# the engine settings above and the backend types that take each
ENGINE_SETTINGS: dict[str, tuple[str, ...]] = {
    "quantization": ("gpu",),
    "kv_cache_dtype": ("gpu",),
    "max_model_len": ("gpu",),
    "max_num_seqs": ("gpu",),
    "gpu_memory_utilization": ("gpu",),
    "device": ("gpu",),
    "dtype": ("gpu",),
    "tensor_parallel_size": ("gpu",),
    "enable_expert_parallel": ("gpu",),
    "pipeline_parallel_size": ("gpu",),
    "kv_offload_gb": ("gpu",),
    "kv_disk_path": ("gpu", "local"),
    "kv_disk_gb": ("gpu", "local"),
    "kv_shared_url": ("gpu",),
    "n_ctx": ("local",),
    "n_parallel": ("local",),
    "n_threads": ("local",),
    "enable_lora": ("gpu", "local"),
    "max_loras": ("gpu", "local"),
    "max_lora_rank": ("gpu",),
    "max_cpu_loras": ("gpu",),
}


def _check_engine_settings(engine_options: dict[str, Any], kind: str) -> None:
    """A setting the chosen backend does not take is an error, not silently dropped."""
    errors = []
    for needed in sorted(set(ENGINE_SETTINGS.values())):
        wrong = sorted(
            n for n in engine_options if ENGINE_SETTINGS[n] == needed and kind not in needed
        )
        if not wrong:
            continue
        hint = ""
        if kind == "local" and {"quantization", "kv_cache_dtype"} & set(wrong):
            hint = " (llama.cpp runs the quantization of its GGUF file: pick a quantized GGUF)"
        errors.append(f"{wrong} need the {' or '.join(needed)} backend, not {kind!r}{hint}")
    if errors:
        raise ValueError("; ".join(errors))


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


def pick_backend_type() -> str:
    """gpu when CUDA is there, else llama.cpp, else the fake backend (the caller says so)."""
    try:
        import torch

        if torch.cuda.is_available() and _importable("gateway.backends.gpu"):
            return "gpu"
    except ImportError:
        pass
    if _importable("llama_cpp") and _importable("gateway.backends.local"):
        return "local"
    return "fake"


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False
