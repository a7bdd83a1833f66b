"""The settings table: every setting a gateway has, its default, what it is for, and the
checks on its value and on how settings combine; and from them the backend entries to
serve. Where the values come from (a TOML file, `KVGATE_*` variables, flags) is
gateway.config_load's; what a backend entry is given besides (the engine settings'
backend types, LoRA, the KV tiers' secret) gateway.config_backends'.
"""

from __future__ import annotations

import re
import socket
import typing
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.backends import BackendSpec, replica_count
from gateway.backends.default_model import starter_backends
from gateway.backends.spec import parse_lora_modules
from gateway.config_backends import (
    ENGINE_SETTINGS,
    check_engine_settings,
    check_no_kv_tier_secret,
    pick_backend_type,
    with_lora,
)
from gateway.config_check import ConfigError, check_parsers, check_types, keep_alive_s, table
from gateway.sqlite_wal import SQLITE_WAL_LIMIT_BYTES
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
        self._check_identity()
        self._check_serving()
        check_parsers(self.reasoning_parser, self.tool_call_parser, "")
        for spec in self.backends:
            replica_count(spec)  # a bad `replicas` is a configuration error, found here
            check_parsers(spec.reasoning_parser, spec.tool_call_parser, f"backend {spec.name!r}: ")
            check_no_kv_tier_secret(spec.options, f"backend {spec.name!r}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router_policy must be one of {ROUTER_POLICIES}, got {self.router_policy!r}"
            )

    def _check_identity(self) -> None:
        """The instance's name and the secrets' lengths."""
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

    def _check_serving(self) -> None:
        """The bounds of how requests are served: fairness, draining, workers and
        replicas, the models directory, images, files and batches, prefill apart."""
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
        check_engine_settings(engine_options, kind)
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
