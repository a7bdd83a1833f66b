"""Counters the worker keeps and the snapshot the engine hands out."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    healthy: bool
    n_parallel: int
    busy: int  # sequences serving a request
    free: int
    waiting: int  # requests queued for a free sequence
    n_ctx: int
    kv_cells_busy: int  # cells held by busy sequences (idle ones keep theirs for reuse)
    prompt_tokens_total: int  # prompt tokens computed
    gen_tokens_total: int
    prefix_query_tokens: int  # prompt tokens of admitted requests
    prefix_reused_tokens: int  # of those, found in the KV cells
    prompt_tokens_per_s: float  # over the last RATE_WINDOW_S (engine_api.throughput)
    gen_tokens_per_s: float
    # the disk tier (kv_disk_path), named as backend_gpu's tiers: prompt tokens restored,
    # records held (one a saved prefix) and their bytes, records written, files refused
    # (foreign, cut short, corrupt), failed writes
    kv_disk_hits: int = 0
    kv_disk_blocks: int = 0
    kv_disk_bytes: int = 0
    kv_disk_blocks_written: int = 0
    kv_disk_rejected: int = 0
    kv_disk_write_errors: int = 0
    # LoRA (enable_lora): the names of the adapters loaded now, and loads so far
    adapters_loaded: list[str] = field(default_factory=list)
    lora_loads: int = 0
