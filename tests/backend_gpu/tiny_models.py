"""Tiny seeded random models (Llama, Qwen2/3, Gemma 3 text and multimodal, Mixtral,
Qwen2/3-MoE, Phi-3) with a locally trained tokenizer, saved like a hub checkpoint so that
the engine and transformers load the same files."""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests.backend_gpu.tiny_deepseek import deepseek_config, spread_biases
from tests.backend_gpu.tiny_gpt_oss import gpt_oss_config, randomize_gpt_oss

VOCAB = 384
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v3_kimi": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen2_moe_norm": "Qwen2MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "phi3_window": "Phi3ForCausalLM",
    "gemma3_mm": "Gemma3ForConditionalGeneration",
}
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets requests join and leave at every step.",
    "Un café très chaud, s'il vous plaît. Déjà vu, naïve façade.",
    "日本語のテキストも少し入れておきます。",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026.",
    "def generate(prompts, sampling_params): return outputs",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A sentencepiece-style BPE (word-start marker, byte fallback) trained on a few lines."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=specials + byte_tokens, show_progress=False
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    assert len(fast) <= VOCAB
    return fast


def _config(arch: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        initializer_range=0.2,  # big enough logit gaps that greedy is well defined
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if arch == "gemma3":
        return _gemma3(common)
    if arch == "mixtral":  # 4 experts of the dense size, top 2, renormalized
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":  # 8 small experts, top 2 not renormalized; layer 1 dense
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        return Qwen3MoeConfig(
            **common, **moe, head_dim=16, norm_topk_prob=False, mlp_only_layers=[1]
        )
    if arch.startswith("qwen2_moe"):
        return _qwen2_moe(common, arch)
    if arch.startswith("phi3"):
        return _phi3(common, arch)
    if arch == "gemma3_mm":
        return _gemma3_multimodal(common)
    if arch == "gpt_oss":
        return gpt_oss_config(common)
    if arch.startswith("deepseek_v3"):
        return deepseek_config(common, arch)
    raise ValueError(arch)


def _qwen2_moe(common: dict, arch: str):
    """8 experts of 32, top 2, and a shared expert of 48 (neither the dense layers' 128
    nor the experts' size, so each is cut by its own). As published: top-k weights not
    renormalized, every layer sparse but those of mlp_only_layers (layer 1 dense);
    "qwen2_moe_norm": renormalized, every second layer sparse (decoder_sparse_step 2)."""
    moe = dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    common = dict(common, num_hidden_layers=3)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common, **moe, norm_topk_prob=False, mlp_only_layers=[1])
    return Qwen2MoeConfig(**common, **moe, norm_topk_prob=True, decoder_sparse_step=2)


def _phi3(common: dict, arch: str):
    """Phi-4-mini's shape ("phi3"): rotary on 3/4 of each head (12 of 16 dimensions),
    LongRoPE from 32 original positions to 256 (6 short and 6 long factors), tied head;
    or Phi-3-mini-4k's ("phi3_window"): whole-head rotary, every layer a window."""
    if arch == "phi3":
        rope = {
            "type": "longrope",
            "short_factor": [1.0, 1.02, 1.1, 1.3, 1.6, 2.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
        }
        return Phi3Config(
            **common,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=32,
            rope_scaling=rope,
            tie_word_embeddings=True,
        )
    return Phi3Config(**common, sliding_window=16, tie_word_embeddings=False)


def _gemma3_multimodal(common: dict):
    """Gemma 3 4B's layout (Gemma3ForConditionalGeneration: a text model beside a SigLIP
    vision tower and its projector), with its global layers' linear rope scaling."""
    text = _gemma3(common).to_dict()
    text["rope_parameters"]["full_attention"] = {
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": 1_000_000.0,
    }
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 4,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
    )


def _gemma3(common: dict):
    common = dict(common, num_hidden_layers=3)
    return Gemma3TextConfig(
        **common,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=16,
    )


def save_tiny_model(arch: str, directory: str) -> str:
    """Write a tiny seeded random `arch` model and its tokenizer to `directory`."""
    path = os.path.join(directory, f"tiny-{arch}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    config = _config(arch)
    config.architectures = [ARCHITECTURES[arch]]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch.startswith("deepseek_v3"):
        spread_biases(model)
    if arch == "gpt_oss":
        randomize_gpt_oss(model)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path
