"""What a memory plan (memory_plan.py) is asked for: the device, the engine settings and
the model's file, each checked here without torch. Importing torch (and transformers,
which imports it) takes seconds, so `kvgate plan` refuses bad input with these checks
before memory_plan is imported, and names what is wrong: the file, its JSON error, or
that a Hugging Face id is not fetched.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_ITEMSIZE = {"auto": None, "fp8": 1}  # None: the model's dtype
QUANTIZATIONS = (None, "fp8", "int8", "int4")
# what a CUDA context and PyTorch's own allocations take before the weights (an estimate;
# the engine measures what is in use instead)
CUDA_CONTEXT_BYTES = 512 * MIB
# owner/name, as a Hugging Face model id is written
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class PlanDevice:
    name: str
    total_bytes: int
    in_use_bytes: int  # before the model loads: the CUDA context, other processes


@dataclass(frozen=True)
class PlanSettings:
    """The engine settings a plan is for (EngineConfig's names and defaults on CUDA)."""

    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "bfloat16"
    quantization: str | None = None  # None, "fp8", "int8", "int4"
    int4_group_size: int = 128
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enforce_eager: bool = False
    tensor_parallel_size: int | None = None  # None: the smallest that fits
    kv_cache_memory_bytes: int | None = None  # the engine's option: no budget sums

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be fp8, int8 or int4, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_ITEMSIZE:
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        for name in ("int4_group_size", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "tensor_parallel_size", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


def check_model_path(path: str) -> None:
    """Raise, naming the file, unless `path` is a model memory_plan can read: an HF
    directory with a config.json, a GGUF file, or a config.json with its model_type."""
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file {path!r} does not exist")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    elif path.endswith(".json"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {path!r} does not exist")
        check_config_json(path)
    elif os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise FileNotFoundError(
                f"{path} has no config.json: give a Hugging Face model directory, a .gguf "
                "file or a config.json"
            )
        check_config_json(config)
    elif not os.path.exists(path) and HUB_ID.fullmatch(path):
        raise FileNotFoundError(
            f"{path!r} is no file or directory here, and kvgate plan downloads nothing. "
            f"For a Hugging Face model, fetch its config (`hf download {path} config.json "
            "--local-dir DIR`) and plan DIR"
        )
    else:
        raise FileNotFoundError(f"model {path!r} is not a directory, a .gguf or a .json file")


def check_config_json(path: str) -> None:
    """Raise, naming `path`, unless it is a JSON object with a model_type."""
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a JSON file: {e.reason}") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"{path}: a config.json names its model_type")
