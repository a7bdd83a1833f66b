"""Engine settings: one llama.cpp context of `n_parallel` sequences, each with its own KV
stream of `n_ctx // n_parallel` cells."""

from __future__ import annotations

import os
from dataclasses import dataclass


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@dataclass
class EngineConfig:
    model_path: str
    n_ctx: int = 16384  # KV cells in all, split evenly between the sequences' streams
    n_parallel: int = 4  # sequences decoded together; each may hold n_ctx // n_parallel cells
    n_batch: int = 512  # tokens per llama_decode call (decode tokens first, then prompt chunks)
    n_threads: int = 0  # 0: one per core, up to 8
    verbose: bool = False  # let llama.cpp print its load log
    enable_kv_events: bool = False  # record prefix blocks stored/removed for take_kv_events()

    def __post_init__(self) -> None:
        if self.n_parallel < 1:
            raise ValueError(f"n_parallel must be >= 1, got {self.n_parallel}")
        if self.n_batch < self.n_parallel:
            raise ValueError(f"n_batch ({self.n_batch}) must be >= n_parallel ({self.n_parallel})")
        if self.n_ctx < self.n_parallel * 16:
            raise ValueError(f"n_ctx ({self.n_ctx}) is too small for {self.n_parallel} sequences")
        if self.n_threads <= 0:
            self.n_threads = default_threads()

    @property
    def n_ctx_per_seq(self) -> int:
        return self.n_ctx // self.n_parallel
