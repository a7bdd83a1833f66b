"""Linear layers whose weight packs several checkpoint tensors, so one matmul does
the work of several (q, k, v) or (gate, up)."""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """Output rows [offset, offset + size) of the weight belong to the shard `name`."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_slices: dict[str, slice] = {}
        start = 0
        for name, size in shards.items():
            self.shard_slices[name] = slice(start, start + size)
            start += size

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        rows = self.shard_slices[shard]
        assert param.data[rows].shape == tensor.shape, (shard, tensor.shape)
        param.data[rows].copy_(tensor)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        sizes = [s.stop - s.start for s in self.shard_slices.values()]
        return list(out.split(sizes, dim=-1))
