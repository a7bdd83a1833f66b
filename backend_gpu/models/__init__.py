"""Model implementations on the paged KV cache, by HF architecture name."""

from __future__ import annotations

from torch import nn

from backend_gpu.models.gemma3 import Gemma3ForCausalLM
from backend_gpu.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in ARCHITECTURES:
        raise NotImplementedError(
            f"architecture {architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[architecture]
