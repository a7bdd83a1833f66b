"""Tiny DeepSeek-V3 configs for the tests (tiny_models.py saves them): one as DeepSeek-V3
and R1 are published, one as Kimi-K2 and DeepSeek-V2-Lite differ from it."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config

# "deepseek_v3": q LoRA, interleaved rope with YaRN (factor 4 over 64 positions, so the
# longer prompts are past it; mscale in the softmax scale), 8 experts in 4 groups of
# which 2 are chosen, top 2, renormalized, one shared expert, layer 0 dense.
# "deepseek_v3_kimi": no q LoRA (one q_proj), rope halves as they are, no scaling; one
# group, not renormalized, two shared experts, biased projections, every layer sparse.
VARIANTS = {
    "deepseek_v3": dict(
        q_lora_rank=48,
        rope_interleave=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            mscale=1.0,
            mscale_all_dim=1.0,
            beta_fast=32,
            beta_slow=1,
        ),
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        n_shared_experts=1,
        first_k_dense_replace=1,
    ),
    "deepseek_v3_kimi": dict(
        q_lora_rank=None,
        rope_interleave=False,
        rope_parameters=dict(rope_type="default", rope_theta=50000.0),
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        n_shared_experts=2,
        first_k_dense_replace=0,
        attention_bias=True,
    ),
}


def deepseek_config(common: dict, arch: str) -> DeepseekV3Config:
    """4 heads of qk 16 + 16 (nope, rope) and v 24 over a latent of 32: no two sizes
    alike, so a wrong split or cut shows."""
    shapes = dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=24,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        routed_scaling_factor=2.5,
    )
    return DeepseekV3Config(**dict(common, **shapes), **VARIANTS[arch])


@torch.no_grad()
def spread_biases(model) -> None:
    """transformers starts biases, the router's correction bias included, at zero: drawn
    instead, so the tests see them used (the correction bias changes which experts win)."""
    gen = torch.Generator().manual_seed(7)
    for name, tensor in model.state_dict().items():
        if name.endswith("bias"):
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
