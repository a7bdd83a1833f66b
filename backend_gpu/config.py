"""Engine settings: what `LLM(...)` accepts, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from backend_gpu.quantization import KV_CACHE_DTYPES, QUANTIZE_PER_CHANNEL
from backend_gpu.spec_decode.config import SpeculativeConfig


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
    enable_kv_events: bool = False  # record blocks stored/removed for take_kv_events()
    scheduling_policy: str = "continuous"  # or "static": a batch runs to its end first
    # between tenants within a priority: "vtc" (fair share, backend_gpu.fairness) or
    # "fcfs" (first come, first served); the static policy is always fcfs
    fairness: str = "vtc"
    max_model_len: int | None = None
    seed: int = 0
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    speculative_config: dict | SpeculativeConfig | None = None  # vLLM's keys, checked

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZE_PER_CHANNEL:
            raise ValueError(
                f"quantization must be None or one of {sorted(QUANTIZE_PER_CHANNEL)}, "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.scheduling_policy not in ("continuous", "static"):
            raise ValueError(
                f"scheduling_policy must be 'continuous' or 'static', got {self.scheduling_policy!r}"
            )
        if self.fairness not in ("vtc", "fcfs"):
            raise ValueError(f"fairness must be 'vtc' or 'fcfs', got {self.fairness!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

    def context_len(self, hf_config) -> int:
        """Tokens a sequence may hold: max_model_len, capped at the model's positions."""
        return min(
            self.max_model_len or hf_config.max_position_embeddings,
            hf_config.max_position_embeddings,
        )
