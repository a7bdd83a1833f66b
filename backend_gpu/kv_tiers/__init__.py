"""Tiers under the device's KV cache: host memory, a disk directory, a shared Redis
store (kv_offload_gb, kv_disk_path and kv_disk_gb, kv_shared_url). The block manager
sees them as one LowerTier (stack.TierStack); `build_tiers` makes it from the
engine's settings, its records keyed by `kv_tier_secret`."""

from __future__ import annotations

from backend_gpu.config import EngineConfig
from backend_gpu.kv_tiers.fingerprint import engine_fingerprint
from backend_gpu.kv_tiers.host import GIB, HostRows, block_bytes
from backend_gpu.kv_tiers.shared import SharedStore
from backend_gpu.kv_tiers.stack import TierStack
from engine_api.kv_disk import DiskStore
from engine_api.kv_records import HEADER_SIZE, RecordCodec

__all__ = ["TierStack", "build_tiers"]

STAGING_BYTES = 256 << 20


def build_tiers(
    config: EngineConfig, attention_layers: list, max_model_len: int
) -> TierStack | None:
    """The stack the settings ask for; None when none is (or prefix caching is off:
    no block then has a key to be found again by)."""
    if not (config.kv_tiers_on and config.enable_prefix_caching):
        return None
    per_block = block_bytes(attention_layers, config.block_size)
    if config.kv_offload_gb:
        num_rows = int(config.kv_offload_gb * GIB) // per_block
        if num_rows < 1:
            raise ValueError(
                f"kv_offload_gb holds {int(config.kv_offload_gb * GIB)} bytes, less than "
                f"one KV block ({per_block} bytes)"
            )
    else:  # rows only to stage what the disk, the shared store or a transfer give back:
        # one sequence's worth, within STAGING_BYTES
        num_rows = min(-(-max_model_len // config.block_size) + 1, STAGING_BYTES // per_block)
        num_rows = max(num_rows, 1)
    codec = RecordCodec(engine_fingerprint(config, attention_layers), config.kv_tier_secret)
    record_bytes = HEADER_SIZE + per_block  # every record is one block
    disk = (
        DiskStore(config.kv_disk_path, int(config.kv_disk_gb * GIB), codec, record_bytes)
        if config.kv_disk_path
        else None
    )
    shared = (
        SharedStore(config.kv_shared_url, codec, record_bytes) if config.kv_shared_url else None
    )
    rows = HostRows(attention_layers, config.block_size, num_rows)
    return TierStack(
        rows, codec, disk, shared, config.enable_kv_events, keeps_evicted=bool(config.kv_offload_gb)
    )
