"""A tiny gpt-oss for the tests (tiny_models.py saves it): two layers, a 16-token window
on the first, YaRN over 64 original positions, 8 experts of 64 with top 4, and a swiglu
limit low enough that the clamps bind; and the weights transformers initializes to zero
(the experts' biases) drawn at random, sinks large enough to take a real share."""

from __future__ import annotations

import torch
from transformers import GptOssConfig

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}


def gpt_oss_config(common: dict) -> GptOssConfig:
    return GptOssConfig(
        **dict(common, intermediate_size=64),
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(YARN),
        swiglu_limit=1.0,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def randomize_gpt_oss(model, seed: int = 0) -> None:
    """Expert biases (zero from transformers' init) and sinks of a real size."""
    gen = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for bias in (experts.gate_up_proj_bias, experts.down_proj_bias):
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.2)
        sinks = layer.self_attn.sinks
        sinks.copy_(torch.randn(sinks.shape, generator=gen))
