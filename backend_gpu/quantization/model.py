"""Quantize a loaded model in place, by method name."""

from __future__ import annotations

from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.layers.linear import QuantizedEmbedding, QuantizedLinear, QuantizedLMHead
from backend_gpu.layers.moe import FusedExperts
from backend_gpu.layers.packed_weight_linear import PackedWeightLinear
from backend_gpu.tp_shards import ROW_PARALLEL


def quantize_model(model: nn.Module, method: str, tp: ParallelGroup = SINGLE) -> None:
    """Swap every linear layer for its `method` version, and the token embedding and
    the LM head (one table when tied) for INT8 with a scale per 32 values of a row.

    vLLM's fp8 keeps the token table in 16 bits, but in a small model it is most of the
    bytes (Gemma 3 270M's 262k x 640 table is 63% of its weights). INT8 in groups of 32
    rather than FP8 per row: measured on Gemma 270M, an FP8 table added 1.5 points of
    perplexity (PERF.md), and a lookup table gains nothing from FP8 tensor cores.

    Under tensor parallelism the ranks quantize their shards together: a row-parallel
    layer's scales are its whole rows', so every rank's 8-bit weights are exactly the
    single-device model's, cut.
    """
    if any(isinstance(m, PackedWeightLinear | QuantizedLinear) for m in model.modules()):
        raise ValueError(
            f"quantization {method!r} quantizes a checkpoint at load, and this one is "
            "already quantized (its config.json has a quantization_config): leave it unset"
        )
    # a pipeline stage may hold either, both or neither (pp_stages.py)
    embed, head = model.model.embed_tokens, model.lm_head
    table = None if embed is None else QuantizedEmbedding(embed.weight)
    model.model.embed_tokens = table
    if head is not None:
        tied = table is not None and head.weight is embed.weight
        model.lm_head = QuantizedLMHead(table if tied else QuantizedEmbedding(head.weight))
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        rows_over = tp if leaf in ROW_PARALLEL else SINGLE
        setattr(owner, leaf, QuantizedLinear.of(getattr(owner, leaf), method, rows_over))
    for module in model.modules():  # a mixture of experts': every expert, as a linear layer
        if isinstance(module, FusedExperts):
            module.quantize(method, tp)
