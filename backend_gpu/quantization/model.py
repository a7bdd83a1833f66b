"""Quantize a loaded model in place, by method name."""

from __future__ import annotations

from torch import nn

from backend_gpu.layers.linear import QuantizedEmbedding, QuantizedLinear

# The token table (the embedding and a tied LM head) is INT8 under either method. vLLM's
# fp8 keeps it in 16 bits, but in a small model it is most of the bytes (Gemma 3 270M's
# 262k x 640 table is 63% of its weights). INT8's even grid keeps 4 more bits per row
# than E4M3's 3-bit mantissa: with an FP8 table, Gemma 270M's perplexity rose 3.0%
# instead of 1.6% (PERF.md), and a lookup table gains nothing from FP8 tensor cores.
TOKEN_TABLE_METHOD = "int8"


def quantize_model(model: nn.Module, method: str) -> None:
    """Swap every linear layer for its `method` version, and the token embedding and
    the LM head for INT8 ones, one scale per vocabulary row; a tied head keeps sharing
    the embedding's table."""
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight
    quantized_embed = QuantizedEmbedding(embed, TOKEN_TABLE_METHOD)
    model.model.embed_tokens = quantized_embed
    model.lm_head = QuantizedLinear(
        model.lm_head, TOKEN_TABLE_METHOD, quantized_embed if tied else None
    )
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name != "lm_head"
    ]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, QuantizedLinear(getattr(owner, leaf), method))
