"""What the configured backends are given besides their entries: the engine settings and
the backend types that take each, LoRA adapters, the KV tiers' secret (one for all
engines, never an engine option), and which backend type `auto` picks. Apart from the
settings table (gateway.config), which resolves its entries with these, so that a worker
(gateway.worker.cli), a reload and the models directory apply them the same way without
the table or its loading.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.backends import BackendSpec
from gateway.backends.spec import LoraModule


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

# the engine settings of Settings (gateway.config) and the backend types that take each
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


def check_engine_settings(engine_options: dict[str, Any], kind: str) -> None:
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


def pick_backend_type() -> str:
    """gpu when CUDA is there, else llama.cpp, else the fake backend (the caller says so)."""
    if _cuda_available() and _importable("gateway.backends.gpu"):
        return "gpu"
    if _importable("llama_cpp") and _importable("gateway.backends.local"):
        return "local"
    return "fake"


def _cuda_available() -> bool:
    """Whether torch sees CUDA. A CPU build of torch (its version says `+cpu`) has none,
    which its metadata tells without importing torch: about 2 CPU-s of an `auto` start on
    a CPU whose engines are all llama.cpp's (`--model x.gguf`, `kvgate worker`)."""
    import importlib.metadata

    try:
        if importlib.metadata.version("torch").endswith("+cpu"):
            return False
        import torch
    except (importlib.metadata.PackageNotFoundError, ImportError):
        return False
    return torch.cuda.is_available()


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False
