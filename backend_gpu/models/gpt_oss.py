"""gpt-oss (GptOssForCausalLM) on the paged KV cache: the Llama family's decoder with
biased q/k/v/o, attention sinks (a learned logit per query head in the softmax's
denominator, layers/attention.py), sliding-window and full layers alternating as
`layer_types` says, YaRN rope as its config has it, and a mixture of experts of its own
(layers/gpt_oss_moe.py: a biased router whose top k logits take a softmax, biased
experts with a clamped SwiGLU). The published checkpoints keep the experts in MXFP4
(`quantization_config` {quant_method: mxfp4}): they are loaded kept packed.

Checkpoints are transformers 5's layout: one stacked tensor per projection for all of a
layer's experts, gate/up [E, H, 2I] and down [E, I, H] transposed against a linear
layer's (16-bit), or [E, 2I, H / 32, 16] blocks and [E, 2I, H / 32] scales (MXFP4, not
transposed). The 16-bit ones are transposed as they are read (`checkpoint_weights`), so
both formats hold [experts, outputs, inputs]. Under tensor parallelism each rank holds a
slice of every expert's intermediate rows (down's MXFP4 columns in whole groups of 32)
or, with expert parallel, whole experts (GptOssExpertShards); every rank holds every
head's sink and uses its own heads'.

What the engine cannot honour of a config (a field transformers' GptOssConfig and the
published config.json do not have, a layer type, a rope parameter, a quantization
setting) is refused at start, naming it (`check_config`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.expert_shards import ExpertShard, MoEConfig
from backend_gpu.layers import cpu_packed
from backend_gpu.layers.attention import AttentionMetadata, paged_attention
from backend_gpu.layers.gpt_oss_moe import (
    BiasedExperts,
    ClampedSwiGLU,
    GptOssRouter,
    Mxfp4Experts,
)
from backend_gpu.layers.linear import Linear, LMHead, PackedLinear
from backend_gpu.layers.norm import RMSNorm
from backend_gpu.layers.rotary import RotaryEmbedding
from backend_gpu.models.llama import LlamaDecoderLayer, LlamaForCausalLM, sliding_window_of
from backend_gpu.quantization import mxfp4
from backend_gpu.tp_shards import SKIP, CheckpointShards, ShardRead, local_heads

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "truncate",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "low_freq_factor",
        "high_freq_factor",
    }
)
# fields of the published config.json that transformers' GptOssConfig lacks: OpenAI's
# own names for what it has (experts_per_token, initial_context_length), older
# transformers' rope fields, the checkpoint's quantization
PUBLISHED_FIELDS = frozenset(
    {
        "experts_per_token",
        "initial_context_length",
        "rope_scaling",
        "rope_theta",
        "torch_dtype",
        "quantization_config",
    }
)
# "model.layers.3.mlp.experts.down_proj_scales" -> ("down_proj", "_scales")
STACKED_TENSOR = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")  # 16-bit: [E, inputs, outputs]


def check_config(config) -> None:
    """Raise ValueError naming the first field of a gpt-oss config the engine cannot
    honour."""
    known = set(type(config)().to_dict()) | PUBLISHED_FIELDS
    for field in config.to_dict():
        if field not in known:
            raise ValueError(f"gpt-oss config field {field!r} is not supported")
    for i, kind in enumerate(config.layer_types):
        if kind not in LAYER_TYPES:
            raise ValueError(f"gpt-oss layer_types[{i}] {kind!r} is not supported")
    if "sliding_attention" in config.layer_types and not config.sliding_window:
        raise ValueError("gpt-oss sliding_attention layers need a sliding_window")
    for key in config.rope_parameters or {}:
        if key not in ROPE_KEYS:
            raise ValueError(f"gpt-oss rope_parameters.{key} is not supported")
    quant = getattr(config, "quantization_config", None)
    if quant:
        mxfp4.check_config(quant)


class GptOssAttention(nn.Module):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: ParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = local_heads(config, tp.size)
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.qkv_proj = PackedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias
        )
        # row-parallel: the ranks' partial sums are added, so the bias is rank 0's alone
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias and tp.rank == 0)
        # every head's (a few numbers): this rank's are a slice, no checkpoint cut needed
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))
        self.first_head = tp.rank * self.num_heads
        self.rotary = rotary
        self.window = sliding_window_of(config, layer)
        self.scale = self.head_dim**-0.5
        self.k_cache = self.v_cache = torch.empty(0)  # set by the model runner
        self.k_scale = self.v_scale = 1.0  # the FP8 cache's, calibrated by the model runner

    def pack_for_cpu(self) -> None:
        """q/k/v and o packed for oneDNN on the CPU (layers/cpu_packed.py), unless 8-bit."""
        for linear in (self.qkv_proj, self.o_proj):
            if isinstance(linear, Linear):
                cpu_packed.pack_linear(linear)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata):
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        sinks = self.sinks[self.first_head : self.first_head + self.num_heads]
        cache = (self.k_cache, self.v_cache)
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        o = paged_attention(q, k, v, *cache, meta, self.scale, self.window, **scales, sinks=sinks)
        return self.tp.all_reduce(self.o_proj(o.flatten(1)))


class GptOssMoE(nn.Module):
    def __init__(
        self, config, moe: MoEConfig, tp: ParallelGroup, expert_parallel: bool, packed: bool
    ) -> None:
        super().__init__()
        self.tp = tp
        self.router = GptOssRouter(config.hidden_size, moe.num_experts, moe.top_k)
        shard = ExpertShard.of(moe, tp, expert_parallel)
        activation = ClampedSwiGLU(getattr(config, "swiglu_alpha", 1.702), config.swiglu_limit)
        experts = Mxfp4Experts if packed else BiasedExperts
        down_bias = not shard.sliced or tp.rank == 0
        self.experts = experts(config.hidden_size, shard, activation, down_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.tp.all_reduce(self.experts(x, weights, ids))


class GptOssDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer: int,
        rotary: RotaryEmbedding,
        tp: ParallelGroup,
        moe: MoEConfig,
        expert_parallel: bool,
        packed: bool,
    ) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, layer, rotary, tp)
        self.mlp = GptOssMoE(config, moe, tp, expert_parallel, packed)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    # pre-norm attention, then pre-norm experts, each added to the residual: Llama's
    forward = LlamaDecoderLayer.forward


class GptOssForCausalLM(LlamaForCausalLM):
    """`expert_parallel`: each rank holds whole experts."""

    # its sinks' attention runs a padded decode group as batched matmuls, not SDPA: on
    # one CPU thread faster than a call per sequence (span_metadata)
    decode_groups_on_one_thread = True

    def __init__(self, config, tp: ParallelGroup = SINGLE, expert_parallel: bool = False) -> None:
        check_config(config)
        moe = MoEConfig.of(config)
        packed = mxfp4.is_mxfp4(config)
        if packed and not expert_parallel and (config.intermediate_size // tp.size) % mxfp4.GROUP:
            raise ValueError(
                f"tensor_parallel_size {tp.size} cuts the MXFP4 experts' intermediate size "
                f"{config.intermediate_size} mid-group (groups of {mxfp4.GROUP}): pick a "
                "size that does not, or enable_expert_parallel"
            )

        def layer(config, i, rotary, tp):
            return GptOssDecoderLayer(config, i, rotary, tp, moe, expert_parallel, packed)

        super().__init__(config, tp, layer)
        # the MXFP4 experts are read as they are (the loader skips its quantized layers)
        self.reads_own_quantization = packed

    def pack_for_cpu(self) -> None:
        """An untied LM head packed for oneDNN on the CPU (layers/cpu_packed.py); a tied
        one is the token table too, which embedding lookups read as it is."""
        table = getattr(self.model.embed_tokens, "weight", None)  # None: another stage's
        if isinstance(self.lm_head, LMHead) and self.lm_head.weight is not table:
            cpu_packed.pack_linear(self.lm_head)

    @staticmethod
    def checkpoint_weights(
        weights: Iterator[tuple[str, torch.Tensor]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """16-bit experts [E, inputs, outputs] as [E, outputs, inputs]."""
        for name, tensor in weights:
            if name.endswith(TRANSPOSED):
                tensor = tensor.transpose(1, 2).contiguous()
            yield name, tensor

    @staticmethod
    def expert_checkpoint_shards(
        moe: MoEConfig, shard: ExpertShard, dense: CheckpointShards
    ) -> GptOssExpertShards:
        return GptOssExpertShards(shard, dense)


class GptOssExpertShards:
    """CheckpointShards for gpt-oss: what a rank reads of the stacked expert tensors
    (whole experts under expert parallel, else its intermediate rows of each: gate/up's
    interleaved rows 2i and 2i + 1 together, down's columns; down's bias on rank 0
    alone); everything else as the dense layers are cut."""

    def __init__(self, shard: ExpertShard, dense: CheckpointShards) -> None:
        self.shard = shard
        self.dense = dense

    def __call__(self, name: str) -> ShardRead | None:
        match = STACKED_TENSOR.search(name)
        if match is None:
            return self.dense(name)
        s = self.shard
        if not s.sliced:  # expert parallel: the rank's experts whole
            return ShardRead(0, s.first, s.first + s.count)
        proj, kind = match.group(1), match.group(2) or ""
        start, stop = s.inter_start, s.inter_start + s.inter
        if proj == "gate_up_proj":  # 16-bit [E, H, 2I]; bias, blocks, scales [E, 2I, ...]
            return ShardRead(2 if kind == "" else 1, 2 * start, 2 * stop)
        if kind == "_bias":  # row-parallel: added once
            return None if start == 0 else SKIP
        if kind == "":  # 16-bit [E, I, H]
            return ShardRead(1, start, stop)
        return ShardRead(2, start // mxfp4.GROUP, stop // mxfp4.GROUP)  # [E, H, I / 32, ...]
