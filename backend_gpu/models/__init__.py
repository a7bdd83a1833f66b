"""Model implementations on the paged KV cache, by HF architecture name; and embedding
models (no cache), by HF model type."""

from __future__ import annotations

from torch import nn

from backend_gpu.models.bert import BertModel
from backend_gpu.models.deepseek_v3 import DeepseekV3ForCausalLM
from backend_gpu.models.gemma3 import Gemma3ForCausalLM
from backend_gpu.models.gemma3_vision import Gemma3VisionForConditionalGeneration
from backend_gpu.models.gpt_oss import GptOssForCausalLM
from backend_gpu.models.llama import LlamaEmbeddingModel, LlamaForCausalLM
from backend_gpu.models.moe import MoEForCausalLM
from backend_gpu.models.phi3 import Phi3ForCausalLM
from backend_gpu.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from backend_gpu.models.qwen2_moe import Qwen2MoeForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # Gemma 3 4B-27B as published: its SigLIP tower and text model (images:
    # backend_gpu.multimodal); its text model alone where images cannot go
    "Gemma3ForConditionalGeneration": Gemma3VisionForConditionalGeneration,
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    # Qwen2.5-VL: its vision tower and M-RoPE decoder (images: backend_gpu.multimodal)
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}

# an embedding model (a sentence-transformers directory) by its config's model_type
EMBEDDING_MODEL_TYPES: dict[str, type[nn.Module]] = {
    "bert": BertModel,
    "llama": LlamaEmbeddingModel,
    "mistral": LlamaEmbeddingModel,
    "qwen2": LlamaEmbeddingModel,
    "qwen3": LlamaEmbeddingModel,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in ARCHITECTURES:
        raise NotImplementedError(
            f"architecture {architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[architecture]


def embedding_model_class(model_type: str) -> type[nn.Module]:
    if model_type not in EMBEDDING_MODEL_TYPES:
        raise NotImplementedError(
            f"embedding models of type {model_type!r} are not supported; "
            f"supported: {sorted(EMBEDDING_MODEL_TYPES)}"
        )
    return EMBEDDING_MODEL_TYPES[model_type]
