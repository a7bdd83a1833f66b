"""A mixture-of-experts model's experts as its config describes them, and which of them
(or which part of each) a tensor-parallel rank holds.

Under plain tensor parallelism every rank holds a slice of every expert, cut as a dense
MLP is (gate/up by intermediate rows, down by intermediate columns), and the ranks'
partial sums are added by the block's all-reduce. With expert parallelism
(`enable_expert_parallel`) rank r holds experts [r * E/N, (r + 1) * E/N) whole and
reads nothing of the others: a large expert count then costs each device 1/N of the
experts' bytes with no cut matmul, and the same all-reduce adds the ranks' outputs
(each token's experts live on one or two ranks; the others add zeros).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from backend_gpu.distributed import ParallelGroup
from backend_gpu.tp_shards import SKIP, CheckpointShards, ShardRead

# "model.layers.3.mlp.experts.5.gate_proj.weight" -> ("model.layers.3.mlp.experts", 5, "gate_proj")
EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
# "model.layers.3.mlp.shared_expert.down_proj.weight" -> "down_proj" (not its gate's)
SHARED_EXPERT_TENSOR = re.compile(r"\.shared_experts?\.(\w+)\.weight$")


@dataclass(frozen=True)
class MoEConfig:
    """What the router and the experts of one sparse block are, from an HF config."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    renormalize: bool  # the top-k probabilities divided by their sum
    leaves: tuple[str, str, str]  # the checkpoint's names of gate, up and down
    sparse_layers: frozenset[int]  # layers with experts; the others a dense MLP
    shared_intermediate: int = 0  # a shared expert's (Qwen2-MoE's), every token takes it

    @classmethod
    def of(cls, hf_config) -> MoEConfig | None:
        """None for a dense model."""
        layers = range(hf_config.num_hidden_layers)
        if hf_config.model_type == "mixtral":
            return cls(
                hf_config.num_local_experts,
                hf_config.num_experts_per_tok,
                hf_config.intermediate_size,
                True,  # softmax over the top k
                ("w1", "w3", "w2"),
                frozenset(layers),
            )
        if hf_config.model_type in ("qwen2_moe", "qwen3_moe"):
            step = hf_config.decoder_sparse_step
            dense = set(hf_config.mlp_only_layers or ())
            sparse = {i for i in layers if i not in dense and (i + 1) % step == 0}
            return cls(
                hf_config.num_experts,
                hf_config.num_experts_per_tok,
                hf_config.moe_intermediate_size,
                bool(hf_config.norm_topk_prob),
                ("gate_proj", "up_proj", "down_proj"),
                frozenset(sparse if hf_config.num_experts > 0 else ()),
                getattr(hf_config, "shared_expert_intermediate_size", 0),
            )
        if hf_config.model_type == "deepseek_v3":  # grouped routing: models/deepseek_v3.py
            first_sparse = hf_config.first_k_dense_replace or 0
            return cls(
                hf_config.n_routed_experts,
                hf_config.num_experts_per_tok,
                hf_config.moe_intermediate_size,
                bool(hf_config.norm_topk_prob),
                ("gate_proj", "up_proj", "down_proj"),
                frozenset(range(first_sparse, hf_config.num_hidden_layers)),
                # n_shared_experts of the routed experts' size, as one MLP
                hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0),
            )
        if hf_config.model_type == "gpt_oss":  # stacked: one tensor for all experts
            return cls(
                hf_config.num_local_experts,
                hf_config.num_experts_per_tok,
                hf_config.intermediate_size,
                True,  # a softmax over the top k logits
                ("gate_up_proj", "gate_up_proj", "down_proj"),
                frozenset(layers),
            )
        return None


@dataclass(frozen=True)
class ExpertShard:
    """Experts [first, first + count) of num_experts, each holding intermediate rows
    [inter_start, inter_start + inter) of its MLP; and rows [shared_start, shared_start +
    shared) of the shared expert's, which is cut as a dense MLP either way."""

    num_experts: int
    first: int
    count: int
    inter_start: int
    inter: int
    sliced: bool  # each expert cut over the ranks (tensor parallel without expert parallel)
    shared_start: int = 0
    shared: int = 0

    @classmethod
    def of(cls, moe: MoEConfig, tp: ParallelGroup, expert_parallel: bool) -> ExpertShard:
        shared = moe.shared_intermediate // tp.size
        shared_rows = (tp.rank * shared, shared)
        if expert_parallel:
            count = moe.num_experts // tp.size
            first = tp.rank * count
            return cls(moe.num_experts, first, count, 0, moe.intermediate_size, False, *shared_rows)
        inter = moe.intermediate_size // tp.size
        sliced = tp.size > 1
        return cls(
            moe.num_experts, 0, moe.num_experts, tp.rank * inter, inter, sliced, *shared_rows
        )


def check_experts_divisible(moe: MoEConfig, size: int, expert_parallel: bool) -> None:
    """Raise ValueError unless the experts split evenly over `size` ranks."""
    if expert_parallel and moe.num_experts % size:
        raise ValueError(
            f"enable_expert_parallel over {size} ranks does not divide the model's "
            f"{moe.num_experts} experts: pick a tensor_parallel_size that does"
        )
    if moe.shared_intermediate % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the shared expert's intermediate "
            f"size {moe.shared_intermediate}: pick a size that does"
        )
    if not expert_parallel and moe.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the experts' intermediate size "
            f"{moe.intermediate_size}: pick a size that does, or enable_expert_parallel"
        )


class ExpertCheckpointShards:
    """CheckpointShards for a mixture-of-experts model: an expert's tensors by the
    rank's ExpertShard, everything else as the dense layers are cut."""

    def __init__(self, moe: MoEConfig, shard: ExpertShard, dense: CheckpointShards) -> None:
        self.gate, self.up, self.down = moe.leaves
        self.shard = shard
        self.dense = dense

    def __call__(self, name: str) -> ShardRead | None:
        match = EXPERT_TENSOR.match(name)
        s = self.shard
        if match is None:
            shared = SHARED_EXPERT_TENSOR.search(name)
            if shared is None or not s.shared:
                return self.dense(name)
            dim = 1 if shared.group(1) == self.down else 0
            return ShardRead(dim, s.shared_start, s.shared_start + s.shared)
        expert, leaf = int(match.group(2)), match.group(3)
        if not s.first <= expert < s.first + s.count:
            return SKIP
        if not s.sliced:  # expert parallel: the expert whole
            return None
        dim = 1 if leaf == self.down else 0
        return ShardRead(dim, s.inter_start, s.inter_start + s.inter)
