"""What a stored block was produced by, so that a tier never hands a block to an engine
that would have computed different numbers: the model's files (their names, sizes and
config: a new revision changes them), the dtype, quantization and load format, the KV
cache's dtype and per-layer scales, its block size and layout, and the tensor-parallel
rank and size."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from backend_gpu.config import EngineConfig
from engine_api.kv_records import fingerprint

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
HEAD_BYTES = 1 << 20


def _model_identity(model: str) -> list:
    """The model's revision as its files show it, without reading all of its weights."""
    path = Path(model)
    if path.is_file():  # a GGUF file: its name, size and its first MiB (the metadata)
        with open(path, "rb") as f:
            head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
        return [path.name, path.stat().st_size, head]
    files = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name == "config.json":
            files.append(["config.json", hashlib.sha256(Path(entry.path).read_bytes()).hexdigest()])
        elif entry.name.endswith(WEIGHT_SUFFIXES):
            files.append([entry.name, entry.stat().st_size])
    return files


def engine_fingerprint(config: EngineConfig, attention_layers: list, rank: int = 0) -> bytes:
    k = attention_layers[0].k_cache
    return fingerprint(
        model=_model_identity(os.fspath(config.model)),
        dtype=config.dtype,
        quantization=config.quantization,
        load_format=config.load_format,
        seed=config.seed if config.load_format == "dummy" else None,
        kv_dtype=str(k.dtype),
        kv_layout=[len(attention_layers), *k.shape[1:]],
        kv_scales=[
            [getattr(a, "k_scale", 1.0), getattr(a, "v_scale", 1.0)] for a in attention_layers
        ],
        block_size=config.block_size,
        tp=[rank, config.tensor_parallel_size],
    )
