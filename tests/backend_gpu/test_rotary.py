"""Rotary tables equal transformers' for the scalings the engine serves: YaRN's
frequencies and its magnitude on cos and sin (DeepSeek-V3's mscale over mscale_all_dim,
gpt-oss's untruncated ramp), bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backend_gpu.layers.rotary import RotaryEmbedding, rope_settings

YARN = [
    # DeepSeek-V3's: factor 40 over 4k positions, mscale over mscale_all_dim (1 here)
    dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
    # gpt-oss's: no truncation of the ramp; the magnitude from the factor alone
    dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, truncate=False),
    dict(factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0),
]


@pytest.mark.parametrize("scaling", YARN)
def test_yarn_tables_are_transformers(scaling):
    params = dict(scaling, rope_type="yarn", rope_theta=10000.0)
    config = DeepseekV3Config(max_position_embeddings=4096 * 40, rope_parameters=params)
    inv_freq, magnitude = ROPE_INIT_FUNCTIONS["yarn"](config)
    rotary = RotaryEmbedding(config.head_dim, 512, *rope_settings(config))
    freqs = torch.outer(torch.arange(512).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    assert torch.equal(rotary.cos, emb.cos() * magnitude)
    assert torch.equal(rotary.sin, emb.sin() * magnitude)
