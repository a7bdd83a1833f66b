"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) on the paged KV cache: the Qwen3-MoE
decoder of models/moe.py (routed experts, some layers dense by `mlp_only_layers` and
`decoder_sparse_step`, `norm_topk_prob` either way), with q/k/v biased (`qkv_bias`) and no
q/k norm, and a shared expert in every sparse block: a dense gated MLP that every token
takes, scaled by a sigmoid gate of the token (`shared_expert_gate`), added to the routed
experts' sum (transformers' Qwen2MoeSparseMoeBlock).

Under tensor parallelism the shared expert is cut as a dense MLP (by its own intermediate
size, expert_shards.py), with or without expert parallel; its partial output joins the
routed experts' before the block's one all-reduce (the sigmoid gate is the same on every
rank, so gate * sum of parts is the sum of gated parts). The gate, like the router, stays
in the model's dtype under FP8/INT8: it is one row, and it scales a whole MLP's output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.distributed import ParallelGroup
from backend_gpu.expert_shards import ExpertShard, MoEConfig
from backend_gpu.layers.linear import Linear, PackedLinear
from backend_gpu.models.moe import MoEDecoderLayer, MoEForCausalLM, SparseMoeBlock


class SharedExpert(nn.Module):
    """down(silu(gate(x)) * up(x)) over this rank's `inter` intermediate rows: a partial
    sum, which the block's all-reduce completes."""

    def __init__(self, hidden_size: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, {"gate": inter, "up": inter}, False)
        self.down_proj = Linear(inter, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class SharedExpertGate(nn.Module):
    """The shared expert's weight per token, sigmoid(x . w); not an nn.Linear, so that
    quantize_model leaves it unquantized."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class SharedExpertMoeBlock(SparseMoeBlock):
    def __init__(self, config, moe: MoEConfig, tp: ParallelGroup, expert_parallel: bool) -> None:
        super().__init__(config, moe, tp, expert_parallel)
        shard = ExpertShard.of(moe, tp, expert_parallel)
        self.shared_expert = SharedExpert(config.hidden_size, shard.shared)
        self.shared_expert_gate = SharedExpertGate(config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed = self.experts(x, weights, ids)
        shared = self.shared_expert_gate(x) * self.shared_expert(x)
        return self.tp.all_reduce(routed + shared)


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    sparse_block = SharedExpertMoeBlock


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE; `expert_parallel`: each rank holds whole routed experts."""

    decoder_layer = Qwen2MoeDecoderLayer
