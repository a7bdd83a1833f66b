"""Engine settings: what `LLM(...)` accepts, checked once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # CPU budget; None: a quarter of free RAM, <= 4 GiB
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "continuous"  # or "static": a batch runs to its end first
    max_model_len: int | None = None
    seed: int = 0
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    speculative_config: dict | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None:
            raise NotImplementedError("quantization is not implemented yet in backend_gpu")
        if self.kv_cache_dtype != "auto":
            raise NotImplementedError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not implemented")
        if self.speculative_config is not None:
            raise NotImplementedError("speculative decoding is not implemented yet in backend_gpu")
        if self.scheduling_policy not in ("continuous", "static"):
            raise ValueError(
                f"scheduling_policy must be 'continuous' or 'static', got {self.scheduling_policy!r}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
