"""Load-time quantization: 8-bit weights with one scale per output channel (FP8 E4M3
or INT8), and the FP8 KV cache. Any checkpoint the loader reads can be quantized."""

from __future__ import annotations

import torch

from backend_gpu.quantization import fp8, int8

# method name -> (weight [out, in], the ranks its rows are split over) ->
# (8-bit weight [out, in], float32 scale [out])
QUANTIZE_PER_CHANNEL = {
    "fp8": fp8.quantize_per_channel,
    "int8": int8.quantize_per_channel,
}
# kv_cache_dtype -> the cache tensors' dtype (None: the model's dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": fp8.FP8}
