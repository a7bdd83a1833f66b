"""DeepSeek-V3 / R1 and Kimi-K2 (DeepseekV3ForCausalLM) on the paged KV cache:
multi-head latent attention (MLA) with its compressed cache, and a mixture of experts
with shared experts and grouped top-k routing.

- Attention: queries through a low-rank q LoRA (q_a_proj, its norm, q_b_proj) or one
  q_proj where q_lora_rank is null; keys and values from one latent per token
  (kv_a_proj_with_mqa, normed) that the cache keeps with the rotary key, a row of
  kv_lora_rank + qk_rope_head_dim per token and layer (layers/mla_attention.py), the
  up-projection kv_b_proj absorbed into the queries and the outputs. The rotary part
  is decoupled (qk_rope_head_dim of each head, and one key shared by all heads),
  interleaved in pairs where rope_interleave says (transformers' layout: rotating the
  even then the odd dims as halves is the same rotation), with YaRN scaling and its
  mscale folded into the softmax scale as transformers does (yarn_apply_mscale).
- MLP: the first first_k_dense_replace layers dense; the others routed experts
  (layers/moe.py) plus n_shared_experts always on. The router: sigmoid scores, plus
  e_score_correction_bias for choosing only; experts chosen within the topk_group of
  n_group groups whose two best corrected scores sum highest; the chosen experts'
  uncorrected scores renormalized (norm_topk_prob) and times routed_scaling_factor.
  The router stays float32 whatever the model's dtype, as transformers keeps it.
- Tensor parallel: heads split (q/q_b and kv_b by heads, o by their columns); the
  latent's projection and norm are replicated, so every rank caches the whole latent
  (vLLM's way: the row is shared by all heads). Experts as Mixtral's (expert_shards.py).

The multi-token-prediction layers some checkpoints carry after the last layer
(num_nextn_predict_layers) are not read: they serve speculative decoding, not the model.
A config field the engine cannot honour is refused at build, naming it.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.expert_shards import ExpertShard, MoEConfig
from backend_gpu.layers.attention import AttentionMetadata
from backend_gpu.layers.linear import Linear
from backend_gpu.layers.mla_attention import mla_attention
from backend_gpu.layers.moe import FusedExperts
from backend_gpu.layers.norm import RMSNorm
from backend_gpu.layers.rotary import RotaryEmbedding, rope_settings, yarn_mscale
from backend_gpu.models.llama import GatedMLP, LlamaDecoderLayer, LlamaForCausalLM
from backend_gpu.models.qwen2_moe import SharedExpert
from backend_gpu.tp_shards import SKIP, CheckpointShards, ShardRead

LATENT_NORM_EPS = (
    1e-6  # q_a_layernorm's and kv_a_layernorm's: transformers' default, not rms_norm_eps
)

# fields of DeepSeek's own config.json that change the model, and the one value each may have
SUPPORTED_VALUES = {
    "hidden_act": "silu",
    "scoring_func": "sigmoid",  # V3's router; V2's softmax is another model
    "topk_method": "noaux_tc",  # grouped top-k with the correction bias
    "moe_layer_freq": 1,  # every layer past the dense ones is sparse
}


# fields of DeepSeek's published config.json (V3, R1, Kimi-K2) that transformers'
# DeepseekV3Config lacks: training's (aux_loss_alpha, seq_aux, ep_size) and the choices
# SUPPORTED_VALUES holds to the one transformers implements
PUBLISHED_FIELDS = frozenset(
    {"aux_loss_alpha", "seq_aux", "ep_size", *SUPPORTED_VALUES, "auto_map", "quantization_config"}
)
# what the rotary tables and the softmax scale read, of the rope types rotary.py computes
ROPE_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
        "low_freq_factor",
        "high_freq_factor",
    }
)


def check_config(config) -> None:
    """Raise NotImplementedError naming the first field the engine cannot honour: one
    neither transformers' DeepseekV3Config nor DeepSeek's config.json has, or a value
    other than the one transformers implements."""
    known = set(type(config)().to_dict()) | PUBLISHED_FIELDS
    for name in config.to_dict():
        if name not in known:
            raise NotImplementedError(
                f"DeepseekV3ForCausalLM config field {name!r} is not supported"
            )
    for key in rope_settings(config)[1] or {}:
        if key not in ROPE_KEYS:
            raise NotImplementedError(
                f"DeepseekV3ForCausalLM rope_parameters.{key} is not supported"
            )
    for name, value in SUPPORTED_VALUES.items():
        got = getattr(config, name, value)
        if got != value:
            raise NotImplementedError(
                f"DeepseekV3ForCausalLM with {name}={got!r} is not supported (only {value!r})"
            )
    experts, groups = config.n_routed_experts, config.n_group or 1
    if experts % groups or experts // groups < 2 or not 1 <= (config.topk_group or 1) <= groups:
        raise NotImplementedError(
            f"DeepseekV3ForCausalLM with n_group={config.n_group}, topk_group="
            f"{config.topk_group} over {experts} experts is not supported"
        )


def softmax_scale(config) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared
    (transformers' yarn_apply_mscale: the whole score, not only the rotary part)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = rope_settings(config)[1] or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... as halves (x0, x2, ...), (x1, x3, ...): rotate-half
    then turns each pair by its frequency, and q . k is unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentProjection(nn.Module):
    """kv_b_proj: the latent's up-projection to each head's key (nope part) and value,
    [heads * (nope + v), kv_lora_rank] as the checkpoint has it, applied absorbed: into
    the queries (W_UK) and onto the attention outputs (W_UV). Not an nn.Linear, so the
    8-bit quantizations leave it in the model's dtype: absorbing reads its values
    (vLLM keeps it unquantized too)."""

    def __init__(self, rank: int, heads: int, nope: int, v_dim: int) -> None:
        super().__init__()
        self.heads, self.nope, self.v_dim = heads, nope, v_dim
        self.weight = nn.Parameter(torch.empty(heads * (nope + v_dim), rank))

    def _per_head(self) -> torch.Tensor:
        return self.weight.view(self.heads, self.nope + self.v_dim, -1)

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> [T, H, R]: q_nope W_UK, each head's query in the latent space."""
        w_uk = self._per_head()[:, : self.nope]  # [H, nope, R]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, R] -> [T, H, v]: each head's output through its W_UV."""
        w_uv = self._per_head()[:, self.nope :]  # [H, v, R]
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class MLAAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, tp: ParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = config.num_attention_heads // tp.size
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank = config.kv_lora_rank
        hidden, bias = config.hidden_size, config.attention_bias
        q_size = self.num_heads * (self.nope + self.rope_dim)
        self.q_lora = config.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(config.q_lora_rank, q_size, bias=False)
        else:  # the checkpoint's q_proj: a name the loader packs into Llama's qkv_proj
            self.q_heads_proj = Linear(hidden, q_size, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(self.rank, self.num_heads, self.nope, config.v_head_dim)
        # row-parallel: the ranks' partial sums are added, so the bias is rank 0's alone
        o_in = self.num_heads * config.v_head_dim
        self.o_proj = Linear(o_in, hidden, bias=bias and tp.rank == 0)
        self.rotary = rotary  # the model's one table (qk_rope_head_dim wide)
        self.interleaved = getattr(config, "rope_interleave", True)
        self.scale = softmax_scale(config)
        self.k_cache = self.v_cache = torch.empty(0)  # set by the model runner; v stays empty
        self.k_scale = self.v_scale = 1.0  # the FP8 cache's (k_scale: the whole row's)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata):
        tokens = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_heads_proj(x)
        q_nope, q_rope = q.view(tokens, self.num_heads, -1).split([self.nope, self.rope_dim], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], -1)
        k_rope = k_rope[:, None]
        if self.interleaved:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = self.rotary(positions, q_rope, k_rope)
        q = torch.cat([self.kv_b_proj.absorb(q_nope), q_rope], dim=-1)  # [T, H, R + P]
        kv = torch.cat([self.kv_a_layernorm(latent), k_rope[:, 0]], dim=-1)  # [T, R + P]
        out = mla_attention(q, kv, self.k_cache, meta, self.scale, self.rank, self.k_scale)
        out = self.kv_b_proj.expand(out)  # [T, H, v]
        return self.tp.all_reduce(self.o_proj(out.flatten(1)))


class GroupedTopKRouter(nn.Module):
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter): (float32 weights [T, k],
    expert ids [T, k]), the weights already times routed_scaling_factor."""

    def __init__(self, config) -> None:
        super().__init__()
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts))
        self.top_k = config.num_experts_per_tok
        self.groups, self.top_groups = config.n_group or 1, config.topk_group or 1
        self.renormalize = bool(config.norm_topk_prob)
        self.scaling = config.routed_scaling_factor

    def _apply(self, fn, recurse=True):
        # float32 whatever the model's dtype (transformers' _keep_in_fp32_modules_strict):
        # the correction bias separates experts by less than bfloat16 resolves
        return super()._apply(lambda t: fn(t).float(), recurse)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.top_groups < self.groups:  # else every group is chosen: no mask
            by_group = choice.view(x.shape[0], self.groups, -1)
            group_scores = by_group.topk(2, dim=-1).values.sum(dim=-1)
            chosen = group_scores.topk(self.top_groups, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
            choice = by_group.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekMoE(nn.Module):
    """Routed experts plus the shared experts every token takes (n_shared_experts of the
    routed size, as one MLP); under tensor parallelism both partial sums end in one
    all-reduce."""

    def __init__(self, config, moe: MoEConfig, tp: ParallelGroup, expert_parallel: bool) -> None:
        super().__init__()
        self.tp = tp
        self.gate = GroupedTopKRouter(config)
        shard = ExpertShard.of(moe, tp, expert_parallel)
        self.experts = FusedExperts(config.hidden_size, shard, moe.leaves)
        self.shared_experts = (
            SharedExpert(config.hidden_size, shard.shared) if shard.shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer: int,
        rotary: RotaryEmbedding,
        tp: ParallelGroup,
        moe: MoEConfig,
        expert_parallel: bool,
    ) -> None:
        super().__init__()
        self.self_attn = MLAAttention(config, rotary, tp)
        if layer in moe.sparse_layers:
            self.mlp = DeepseekMoE(config, moe, tp, expert_parallel)
        else:
            self.mlp = GatedMLP(config, F.silu, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    forward = LlamaDecoderLayer.forward  # pre-norm attention, then pre-norm MLP


class DeepseekCheckpointShards(CheckpointShards):
    """What a tensor-parallel rank reads: its heads' rows of q (q_proj or q_b_proj) and
    of kv_b_proj, their columns of o_proj; the latent's projections (q_a, kv_a) and norms
    whole; the rest as Llama's (experts and shared experts: expert_shards.py)."""

    def __init__(self, hf_config, head_dim: int, tp: ParallelGroup) -> None:
        super().__init__(hf_config, head_dim, tp)
        heads = hf_config.num_attention_heads // tp.size
        first = tp.rank * heads
        qk = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
        kv = hf_config.qk_nope_head_dim + hf_config.v_head_dim
        v = hf_config.v_head_dim
        self.rows = {"q_proj": qk, "q_b_proj": qk, "kv_b_proj": kv}
        self.heads = (first, heads)
        self.o = (first * v, heads * v)

    def __call__(self, name: str) -> ShardRead | None:
        if self.tp.size == 1:
            return None
        module_path, _, param = name.rpartition(".")
        leaf = module_path.rpartition(".")[2]
        first, heads = self.heads
        if leaf in self.rows:
            size = self.rows[leaf]
            return ShardRead(0, first * size, (first + heads) * size)
        if leaf == "o_proj":
            if param == "bias":
                return None if self.tp.rank == 0 else SKIP
            return ShardRead(1, self.o[0], sum(self.o))
        return super().__call__(name)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """`expert_parallel`: each rank holds whole experts."""

    checkpoint_shards = DeepseekCheckpointShards
    # the LoRA stacks adapt Llama's q/k/v/o/gate/up/down; MLA's projections are others
    supports_lora = False

    def __init__(self, config, tp: ParallelGroup = SINGLE, expert_parallel: bool = False) -> None:
        check_config(config)
        moe = MoEConfig.of(config)
        layer = partial(DeepseekDecoderLayer, moe=moe, expert_parallel=expert_parallel)
        super().__init__(config, tp, layer)
        self.num_layers = config.num_hidden_layers

    def checkpoint_name(self, name: str) -> str | None:
        """Ours of a checkpoint tensor's name; None for the multi-token-prediction layers
        past the last (model.layers.61 of DeepSeek-V3), which the engine does not run."""
        if name.startswith("model.layers.") and int(name.split(".", 3)[2]) >= self.num_layers:
            return None
        return name.replace(".self_attn.q_proj.", ".self_attn.q_heads_proj.")
