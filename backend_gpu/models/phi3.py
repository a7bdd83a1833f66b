"""Phi-3 and Phi-4 (Phi3ForCausalLM: Phi-3-mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini)
on the paged KV cache. The decoder is Llama's; what differs is read here:

- The checkpoint fuses q, k and v into one `qkv_proj` tensor and gate and up into one
  `gate_up_proj`, rows in that order. The loader reads each as its parts, named as an
  unfused checkpoint names them (fused_checkpoint_tensors), so a tensor-parallel rank
  reads only its heads' and its intermediate rows of each part, as for Llama.
- Partial rotary (`partial_rotary_factor`, Phi-4-mini's 0.75): only the first
  head_dim * factor dimensions of q and k are rotated, the rest pass through.
- LongRoPE (`rope_scaling` type "longrope", or "su" as older configs say): the inverse
  frequencies are divided per dimension by `short_factor` or `long_factor`, and cos and
  sin multiplied by the attention factor (given, else sqrt(1 + ln(factor) / ln(original
  positions))). transformers picks the factors per forward by the longest position in it,
  so one sequence can hold keys rotated both ways; here they are picked once, by the
  context the engine serves (max_model_len, set_context_len): the long ones where it
  exceeds `original_max_position_embeddings`, as llama.cpp picks them by its context
  size. Every key of every sequence is then rotated alike, so paged and prefix-cached
  blocks hold the same values whichever request computed them. Against transformers this
  is token for token where it is consistent itself: an engine of at most the original
  context (short factors), or prompts longer than it (transformers' long factors).
- `sliding_window` applies to every layer (models/llama.py's sliding_window_of).
"""

from __future__ import annotations

import math

import torch

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.layers.rotary import RotaryEmbedding, _rotate_half, rope_settings
from backend_gpu.models.llama import LlamaForCausalLM, head_dim_of


def longrope_attention_factor(config, scaling: dict) -> float:
    """What LongRoPE multiplies cos and sin by (transformers' _compute_longrope_parameters)."""
    original = original_positions(config, scaling)
    factor = scaling.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def original_positions(config, scaling: dict) -> int:
    """The context the model was pretrained at, where LongRoPE's long factors begin."""
    original = scaling.get("original_max_position_embeddings")
    return original or config.original_max_position_embeddings


def rope_kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


class Phi3RotaryEmbedding(RotaryEmbedding):
    """Tables over the first `rotary_dim` dimensions of a head, with LongRoPE's factors
    (short or long, see the module's docstring) and attention factor where the config
    has them; forward rotates those dimensions and passes the others through."""

    def __init__(self, config) -> None:
        theta, scaling = rope_settings(config)
        partial = (scaling or {}).get("partial_rotary_factor") or getattr(
            config, "partial_rotary_factor", 1.0
        )
        self.rotary_dim = int(head_dim_of(config) * partial)
        self.longrope = rope_kind(scaling) in ("longrope", "su")
        self.magnitude = 1.0
        self.long = False
        if self.longrope:
            self.original = original_positions(config, scaling)
            self.magnitude = longrope_attention_factor(config, scaling)
            self.long = config.max_position_embeddings > self.original  # until set_context_len
        super().__init__(self.rotary_dim, config.max_position_embeddings, theta, scaling)

    def set_context_len(self, context_len: int) -> None:
        """Pick LongRoPE's factors for an engine serving `context_len` positions (before
        compute_tables)."""
        if self.longrope:
            self.long = context_len > self.original

    def check_scaling(self) -> None:
        if not self.longrope:  # LongRoPE's factors were read above
            super().check_scaling()

    def compute_tables(self) -> None:
        if not self.longrope:
            super().compute_tables()
            return
        dim, max_positions, theta, scaling = self.settings
        device = self.cos.device
        # transformers' order of operations, so the tables are its bits
        ext = torch.tensor(scaling["long_factor" if self.long else "short_factor"])
        inv_freq = 1.0 / (ext * theta ** (torch.arange(0, dim, 2).float() / dim))
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos() * self.magnitude, emb.sin() * self.magnitude

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.rotary_dim
        if d == q.shape[-1]:
            return super().forward(positions, q, k)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            rot = x[..., :d]
            return torch.cat([rot * cos + _rotate_half(rot) * sin, x[..., d:]], dim=-1)

        return rotate(q), rotate(k)


def fused_checkpoint_tensors(config):
    """The loader's map of a fused checkpoint tensor's name to its parts [(name,
    rows)], in the order of its rows; None for an unfused tensor."""
    head_dim = head_dim_of(config)
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    parts = {
        "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
        "gate_up_proj": (("gate_proj", inter), ("up_proj", inter)),
    }

    def split(name: str) -> list[tuple[str, int]] | None:
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf not in parts or param != "weight":
            return None
        return [(f"{parent}.{part}.{param}", rows) for part, rows in parts[leaf]]

    return split


class Phi3ForCausalLM(LlamaForCausalLM):
    fused_checkpoint_tensors = staticmethod(fused_checkpoint_tensors)

    def __init__(self, config, tp: ParallelGroup = SINGLE) -> None:
        if config.hidden_act != "silu":
            raise NotImplementedError(
                f"config field hidden_act: {config.hidden_act!r} is not supported (silu)"
            )
        # another rope kind is RotaryEmbedding's, which refuses one it does not have
        rotary = Phi3RotaryEmbedding(config)
        super().__init__(config, tp, rotary=rotary)
        self.rotary = rotary

    def set_context_len(self, context_len: int) -> None:
        """The loader's hook: the engine serves `context_len` positions."""
        self.rotary.set_context_len(context_len)
