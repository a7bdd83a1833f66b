"""Rotary position embedding (the rotate-half layout of HF checkpoints)."""

from __future__ import annotations

import math

import torch
from torch import nn


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_frequencies(head_dim, theta, scaling)
    raise NotImplementedError(
        f"config field rope_scaling (rope_parameters): type {kind!r} is not supported; "
        "supported: default, linear, llama3, yarn (and Phi-3's longrope)"
    )


def _yarn_inv_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): the low frequencies interpolated
    by `factor`, the high ones kept, a linear ramp between the two correction dims."""
    old_len = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no ramp of width 0
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # in transformers' order of operations, so the tables are its bits
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return 1.0 / (scaling["factor"] * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, 0.1 * mscale * ln(factor) + 1 (1 for no stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (1 for every other kind): its
    attention_factor, else mscale over mscale_all_dim (DeepSeek's), else mscale(factor)."""
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, mscale, all_dim = (
        scaling["factor"],
        scaling.get("mscale"),
        scaling.get("mscale_all_dim"),
    )
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """cos and sin of every position, float32: a model makes one and its layers share
    it (a table of 128k positions is 128 MiB at head size 128)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.settings = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if self.cos.device.type != "meta":
            self.compute_tables()
            return
        # on the meta device (the loader's build) the tables are computed once given
        # memory (meta tensors compute through torch's reference ops, which import
        # torch._dynamo); the scaling is still checked now
        self.check_scaling()

    def check_scaling(self) -> None:
        """Refuse a scaling these tables cannot honour, naming the field: computes the
        frequencies (a few values) on the CPU."""
        head_dim, _, theta, scaling = self.settings
        with torch.device("cpu"):
            inv_frequencies(head_dim, theta, scaling)

    def compute_tables(self) -> None:
        """(Re)compute the tables where the module lives: after a model built on the
        meta device is given memory, they hold garbage until this runs."""
        head_dim, max_positions, theta, scaling = self.settings
        device = self.cos.device
        inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        magnitude = attention_factor(scaling)
        self.cos, self.sin = emb.cos() * magnitude, emb.sin() * magnitude

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] -> rotated, same dtype."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_settings(config, layer_type: str = "full_attention") -> tuple[float, dict | None]:
    """(theta, scaling) of a layer type, from a transformers v4 or v5 config."""
    params = getattr(config, "rope_parameters", None)
    if params:
        if layer_type in params:  # one entry per layer type (Gemma 3)
            params = params[layer_type]
        scaling = dict(params)
        theta = scaling.pop("rope_theta")
        return theta, scaling
    if layer_type == "sliding_attention" and hasattr(config, "rope_local_base_freq"):
        return config.rope_local_base_freq, None
    return config.rope_theta, getattr(config, "rope_scaling", None)
