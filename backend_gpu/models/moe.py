"""Mixture-of-experts decoders on the paged KV cache: Mixtral and Qwen3-MoE. Attention is
the Llama family's (Qwen3-MoE with its per-head q/k norm); the MLP of a sparse layer is
a router and experts (layers/moe.py), of the others (Qwen3-MoE's mlp_only_layers,
decoder_sparse_step) the dense one. Neither has a shared expert (Qwen2-MoE's, which
models/qwen2_moe.py adds to this decoder).

Checkpoints name the block `block_sparse_moe` (Mixtral) or `mlp` (Qwen3-MoE); ours is
`mlp` in both, as in transformers 5. Under tensor parallelism each rank holds a slice
of every expert, or with expert_parallel whole experts (expert_shards.py); either way
the block ends in one all-reduce, as a dense MLP does."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.expert_shards import ExpertShard, MoEConfig
from backend_gpu.layers.moe import FusedExperts, TopKRouter
from backend_gpu.layers.rotary import RotaryEmbedding
from backend_gpu.models.llama import GatedMLP, LlamaDecoderLayer, LlamaForCausalLM


class SparseMoeBlock(nn.Module):
    def __init__(self, config, moe: MoEConfig, tp: ParallelGroup, expert_parallel: bool) -> None:
        super().__init__()
        self.tp = tp
        self.gate = TopKRouter(config.hidden_size, moe.num_experts, moe.top_k, moe.renormalize)
        shard = ExpertShard.of(moe, tp, expert_parallel)
        self.experts = FusedExperts(config.hidden_size, shard, moe.leaves)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.tp.all_reduce(self.experts(x, weights, ids))


class MoEDecoderLayer(LlamaDecoderLayer):
    sparse_block = SparseMoeBlock  # a sparse layer's MLP (Qwen2-MoE's adds a shared expert)

    def __init__(
        self,
        config,
        layer: int,
        rotary: RotaryEmbedding,
        tp: ParallelGroup,
        moe: MoEConfig,
        expert_parallel: bool,
    ) -> None:
        super().__init__(config, layer, rotary, tp)
        if layer in moe.sparse_layers:
            self.mlp = self.sparse_block(config, moe, tp, expert_parallel)
        else:
            self.mlp = GatedMLP(config, F.silu, tp)


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral and Qwen3-MoE; `expert_parallel`: each rank holds whole experts."""

    decoder_layer = MoEDecoderLayer

    def __init__(self, config, tp: ParallelGroup = SINGLE, expert_parallel: bool = False) -> None:
        if config.hidden_act != "silu":
            raise NotImplementedError(f"experts with {config.hidden_act!r} are not supported")
        moe = MoEConfig.of(config)
        if moe is None:
            raise ValueError(f"{config.model_type!r} is not a mixture-of-experts model")
        layer = partial(self.decoder_layer, moe=moe, expert_parallel=expert_parallel)
        super().__init__(config, tp, layer)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")
