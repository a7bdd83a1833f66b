"""The token embedding and the LM head split over the vocabulary between tensor-parallel
ranks: each rank holds VocabShard.rows rows of the table. A lookup takes the rows this
rank holds (zeros for the others) and one all-reduce sums them; logits are computed per
shard and gathered to rank 0, the padding cut. Works over any table module (a plain or
an 8-bit embedding, a plain or an 8-bit head), so quantization needs no TP version."""

from __future__ import annotations

import torch
from torch import nn

from backend_gpu.distributed import ParallelGroup
from backend_gpu.tp_shards import VocabShard


def embed(table: nn.Module, input_ids: torch.Tensor, shard: VocabShard, tp: ParallelGroup):
    """Rows of `input_ids` from a table split over the ranks."""
    if tp.size == 1:
        return table(input_ids)
    local = input_ids - shard.start
    inside = (local >= 0) & (local < shard.rows)
    x = table(local.masked_fill(~inside, 0))
    return tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))


def gather_logits(
    logits: torch.Tensor, shard: VocabShard, tp: ParallelGroup
) -> torch.Tensor | None:
    """Rank 0: the logits over the whole vocabulary; the other ranks: None."""
    full = tp.gather_last_dim(logits)
    if full is None or full.shape[-1] == shard.vocab_size:
        return full
    return full[:, : shard.vocab_size]
