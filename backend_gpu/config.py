"""Engine settings: what `LLM(...)` accepts, checked once."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from backend_gpu.quantization import KV_CACHE_DTYPES, QUANTIZE_PER_CHANNEL
from backend_gpu.spec_decode.config import SpeculativeConfig

log = logging.getLogger(__name__)
MAX_LORA_RANK = 128  # the LoRA kernels' (layers/triton_lora.py)


def auto_device() -> str:
    """What device "auto" means: CUDA when torch sees a GPU, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    model: str
    # "auto": CUDA when torch sees a GPU, else the CPU; resolved here, once
    device: str = "auto"
    # "auto": bfloat16 on CUDA, float32 on the CPU
    dtype: str = "auto"
    block_size: int = 16
    # the KV cache's bytes, on any device (as vLLM's option); None: on CUDA what
    # gpu_memory_utilization leaves, on the CPU a tenth of free RAM, at most 2 GiB
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # tiers under the KV cache (backend_gpu/kv_tiers): blocks it evicts are written
    # down, and a prefix hit in any tier is loaded back instead of recomputed.
    # GiB of host memory (pinned on CUDA); 0: none (a staging area when another tier is on)
    kv_offload_gb: float = 0
    # a directory of blocks that outlives the engine, and its size in GiB
    kv_disk_path: str | None = None
    kv_disk_gb: float = 16
    # a store shared by engines of the same model: "redis://host:port/db"
    kv_shared_url: str | None = None
    # blocks sent to and taken from another engine (prefill on one worker, decode on
    # another): export_kv / import_kv; host rows to stage them
    kv_transfer: bool = False
    # the key of the MAC on every block those tiers store or move (engine_api.kv_records),
    # shared by the engines that read each other's blocks; None: one of this engine's own
    kv_tier_secret: str | None = field(default=None, repr=False)
    # CUDA: no CUDA graphs, every step eager (vLLM's flag); elsewhere always eager
    enforce_eager: bool = False
    # "dummy": random weights in place of the checkpoint's (vLLM's load format, for
    # benchmarks); the directory still gives the config and the tokenizer
    load_format: str = "auto"
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
    # ranks the model is split over (Megatron-style, tp_shards.py), one process and one
    # device each: GPUs device, device + 1, ... on CUDA; on the CPU, processes sharing it
    tensor_parallel_size: int = 1
    # stages the layers are split into (pp_stages.py), each of tensor_parallel_size ranks:
    # pipeline_parallel_size x tensor_parallel_size processes and devices in all
    pipeline_parallel_size: int = 1
    # a mixture of experts' tensor-parallel ranks each hold whole experts, a share of
    # them, instead of a slice of every expert (vLLM's flag; expert_shards.py)
    enable_expert_parallel: bool = False
    # LoRA adapters per request (backend_gpu/lora, vLLM's names): max_loras resident on
    # the device at once, ranks up to max_lora_rank, max_cpu_loras kept in host memory
    # (None: 2 * max_loras), each least recently used out
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    # vision models (backend_gpu.multimodal): image tokens the encoder cache keeps (the
    # tower's output per image, least recently used out; 0: none kept), and the pixels
    # an image is resized down to at most (None: the model's processor's max_pixels);
    # not the gateway's max_image_pixels, which refuses an image larger than it
    encoder_cache_tokens: int = 16384
    resize_image_pixels: int | None = None
    # the older name of resize_image_pixels: taken, with a deprecation warning
    max_image_pixels: int | None = None

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
        self._resolve_device_and_dtype()
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        self._check_tensor_parallel_size()
        self._check_pipeline_parallel_size()
        self._check_kv_offload()
        self._check_lora()
        if isinstance(self.encoder_cache_tokens, bool) or not isinstance(
            self.encoder_cache_tokens, int
        ):
            raise ValueError(
                f"encoder_cache_tokens must be an int >= 0, got {self.encoder_cache_tokens!r}"
            )
        if self.encoder_cache_tokens < 0:
            raise ValueError(f"encoder_cache_tokens must be >= 0, got {self.encoder_cache_tokens}")
        self._check_resize_image_pixels()

    def _check_resize_image_pixels(self) -> None:
        if self.max_image_pixels is not None:
            if self.resize_image_pixels is not None:
                raise ValueError(
                    "give resize_image_pixels, not also max_image_pixels (its old name)"
                )
            log.warning(
                "max_image_pixels on the gpu engine is deprecated: it is resize_image_pixels "
                "(the gateway's max_image_pixels refuses an image, this resizes it)"
            )
            self.resize_image_pixels, self.max_image_pixels = self.max_image_pixels, None
        mp = self.resize_image_pixels
        if mp is not None and (isinstance(mp, bool) or not isinstance(mp, int) or mp < 784):
            raise ValueError(f"resize_image_pixels must be None or an int >= 784, got {mp!r}")

    @property
    def kv_tiers_on(self) -> bool:
        """Whether any tier is asked for below the KV cache."""
        return bool(
            self.kv_offload_gb or self.kv_disk_path or self.kv_shared_url or self.kv_transfer
        )

    def _check_kv_offload(self) -> None:
        for name in ("kv_offload_gb", "kv_disk_gb"):
            gb = getattr(self, name)
            if isinstance(gb, bool) or not isinstance(gb, int | float) or not math.isfinite(gb):
                raise ValueError(f"{name} must be a finite number >= 0, got {gb!r}")
            if gb < 0:
                raise ValueError(f"{name} must be >= 0, got {gb!r}")
        url = self.kv_shared_url
        if url is not None and not (
            isinstance(url, str) and url.startswith(("redis://", "rediss://", "unix://"))
        ):
            raise ValueError(f"kv_shared_url must be a redis:// URL, got {url!r}")
        if self.kv_tiers_on and self.tensor_parallel_size > 1:
            raise ValueError(
                "kv_offload_gb, kv_disk_path and kv_shared_url do not work with "
                "tensor_parallel_size > 1 yet"
            )

    def _check_lora(self) -> None:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 2 * self.max_loras
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK}, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    def _check_tensor_parallel_size(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be an int >= 1, got {size!r}")
        size = self.tensor_parallel_size * self.pipeline_parallel_size
        device = torch.device(self.device)
        if device.type == "cuda":
            needed = (device.index or 0) + size
            if needed > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size x pipeline_parallel_size {size} from "
                    f"{self.device} needs {needed} GPUs; torch sees {torch.cuda.device_count()}"
                )

    def _check_pipeline_parallel_size(self) -> None:
        """What pipeline stages do not run yet: each of these needs the whole model (or
        every layer's cache) in one process."""
        if self.pipeline_parallel_size == 1:
            return
        unsupported = {
            "speculative_config": self.speculative_config is not None,
            "enable_lora": self.enable_lora,
            "kv_cache_dtype": self.kv_cache_dtype != "auto",
            "kv_offload_gb, kv_disk_path, kv_shared_url, kv_transfer": self.kv_tiers_on,
        }
        named = [name for name, is_set in unsupported.items() if is_set]
        if named:
            raise ValueError(
                f"pipeline_parallel_size > 1 does not work with {', '.join(named)} yet"
            )

    def _resolve_device_and_dtype(self) -> None:
        if self.device == "auto":
            self.device = auto_device()
        try:
            kind = torch.device(self.device).type
        except RuntimeError:
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: torch sees no CUDA GPU")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if kind == "cuda" else "float32"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.dtype == "float16" and kind == "cpu":
            raise ValueError("float16 is for CUDA; use float32 or bfloat16 on the CPU")

    def context_len(self, hf_config) -> int:
        """Tokens a sequence may hold: max_model_len, capped at the model's positions."""
        return min(
            self.max_model_len or hf_config.max_position_embeddings,
            hf_config.max_position_embeddings,
        )
