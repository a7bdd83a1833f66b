"""Engine settings: one llama.cpp context of `n_parallel` sequences, each with its own KV
stream of `n_ctx // n_parallel` cells. With task "embed" the engine embeds instead of
generating (backend_local.embed_worker): inputs of up to `n_ctx // n_parallel` tokens,
pooled by `pooling` (None: the GGUF's own, else mean) and L2-normalized if `normalize`.
With `mmproj` a generating engine takes images (backend_local.vision)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import llama_cpp

# llama.cpp's pooling types an embedding engine may use, by name
POOLINGS = {
    "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
    "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
}


def default_threads() -> int:
    """One thread a core this process may run on (its affinity: taskset, a container's
    cpuset), up to 8: llama.cpp's threads meet at a barrier after every op, and one more
    than there are cores spins there while the core it waits for runs another."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS (macOS)
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


@dataclass
class EngineConfig:
    model_path: str
    n_ctx: int = 16384  # KV cells in all, split evenly between the sequences' streams
    n_parallel: int = 4  # sequences decoded together; each may hold n_ctx // n_parallel cells
    n_batch: int = 512  # tokens per llama_decode call (decode tokens first, then prompt chunks)
    n_threads: int = 0  # 0: one per core, up to 8
    verbose: bool = False  # let llama.cpp print its load log
    enable_kv_events: bool = False  # record prefix blocks stored/removed for take_kv_events()
    task: str = "generate"  # "generate" or "embed"
    pooling: str | None = None  # "mean" | "cls" | "last" (embed only); None: the GGUF's own
    normalize: bool = True  # embed only: unit vectors, as llama-server's /v1/embeddings
    # a directory where prompts' computed prefixes are saved, outliving the engine
    # (kv_disk_tier.py); None: off. At most kv_disk_gb GiB, least recently used out.
    kv_disk_path: str | None = None
    kv_disk_gb: float = 16
    # the key of the MAC on every saved prefix (engine_api.kv_records), shared by the
    # engines that read each other's; None: one of this engine's own
    kv_tier_secret: str | None = field(default=None, repr=False)
    # LoRA adapters (GGUF LoRA files, lora.py): requests may name one; at most max_loras
    # stay loaded, least recently used out
    enable_lora: bool = False
    max_loras: int = 4
    # a vision projector GGUF (llama.cpp's --mmproj) for the model: requests may carry
    # images (backend_local.vision); None: text only
    mmproj: str | None = None

    def __post_init__(self) -> None:
        if self.n_parallel < 1:
            raise ValueError(f"n_parallel must be >= 1, got {self.n_parallel}")
        if self.n_batch < self.n_parallel:
            raise ValueError(f"n_batch ({self.n_batch}) must be >= n_parallel ({self.n_parallel})")
        if self.n_ctx < self.n_parallel * 16:
            raise ValueError(f"n_ctx ({self.n_ctx}) is too small for {self.n_parallel} sequences")
        if self.task not in ("generate", "embed"):
            raise ValueError(f"task must be 'generate' or 'embed', got {self.task!r}")
        if self.pooling not in (None, *POOLINGS):
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        gb = self.kv_disk_gb
        if isinstance(gb, bool) or not isinstance(gb, int | float) or not 0 <= gb < math.inf:
            raise ValueError(f"kv_disk_gb must be a finite number >= 0, got {gb!r}")
        if self.kv_disk_path is not None and self.task == "embed":
            raise ValueError("kv_disk_path keeps generated prefixes; an embedding engine has none")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.enable_lora and self.task == "embed":
            raise ValueError("enable_lora serves generation; an embedding engine has no adapters")
        if self.mmproj is not None and self.task == "embed":
            raise ValueError("mmproj serves images to a generator; an embedding engine takes none")
        if self.n_threads <= 0:
            self.n_threads = default_threads()

    @property
    def n_ctx_per_seq(self) -> int:
        return self.n_ctx // self.n_parallel
