"""Quantize a loaded model in place, by method name."""

from __future__ import annotations

from torch import nn

from backend_gpu.layers.linear import QuantizedLinear


def quantize_model(model: nn.Module, method: str) -> None:
    """Swap every linear layer of the decoder for its 8-bit version.

    The token embeddings and the LM head (often one tied tensor) stay as loaded: an
    embedding is a lookup, not a matmul, and the logits are where rounding errors
    change the chosen token most; vLLM's fp8 leaves them alone too.
    """
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name != "lm_head"
    ]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, QuantizedLinear(getattr(owner, leaf), method))
