"""Tiny random models of three families llama.cpp serves (Qwen2-MoE, Phi-3 with partial
rotary and LongRoPE, Gemma 3 as published: its multimodal checkpoint's text model), saved as Hugging Face checkpoints for transformers' reference
and written as float32 GGUF files with gguf-py, as llama.cpp's convert_hf_to_gguf.py
writes them (that script lives in llama.cpp's source tree, which the installed
llama-cpp-python wheel and gguf package do not carry): gguf-py's tensor name map, the
experts stacked into one tensor per projection, Gemma's norms stored as 1 + weight, Phi-3's
LongRoPE factors as tensors beside its attention factor and original context.

The shapes are the ones llama.cpp can express: every Qwen2-MoE layer sparse (it has no
dense layers: gguf-py has no names for their tensors), top-k weights not renormalized (as
published); Gemma 3 with every sixth layer global (its fixed pattern, whatever
`layer_types` says); Phi-3 without a sliding window (llama.cpp does not apply Phi's as
transformers does: a windowed one's output differs past the window)."""

from __future__ import annotations

import glob
import math
import os

import gguf
import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3Config,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
)

from tests.backend_gpu.tiny_models import VOCAB, build_tokenizer

FAMILIES = ("qwen2_moe", "phi3", "gemma3_mm")
COMMON = dict(
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


def _config(family: str):
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            **COMMON,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            architectures=["Qwen2MoeForCausalLM"],
        )
    if family == "phi3":
        rope = {
            "type": "longrope",
            "short_factor": [1.0, 1.02, 1.1, 1.3, 1.6, 2.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
        }
        return Phi3Config(
            **COMMON,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=32,
            rope_scaling=rope,
            architectures=["Phi3ForCausalLM"],
        )
    text = dict(COMMON, num_hidden_layers=6, head_dim=16, sliding_window=16)
    text.update(query_pre_attn_scalar=16, rope_scaling={"rope_type": "linear", "factor": 8.0})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    vision.update(num_attention_heads=2, image_size=32, patch_size=8)
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 4,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        architectures=["Gemma3ForConditionalGeneration"],
    )


def save_family(family: str, directory: str) -> str:
    """A tiny seeded random model of `family` and its tokenizer, as transformers saves it."""
    path = os.path.join(directory, f"tiny-gguf-{family}")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
        model.save_pretrained(path)
        build_tokenizer().save_pretrained(path)
    return path


def write_gguf(hf_dir: str, path: str, add_bos: bool = False) -> str:
    """The float32 GGUF of the checkpoint in `hf_dir` (one of FAMILIES); its path.
    `add_bos`: the vocabulary says a BOS token starts every text (Gemma's GGUFs do)."""
    config = AutoConfig.from_pretrained(hf_dir)
    text = getattr(config, "text_config", None) or config
    arch = {"qwen2_moe": "qwen2moe", "phi3": "phi3", "gemma3_text": "gemma3"}[text.model_type]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _hyperparameters(writer, text, arch)
    _vocabulary(writer, hf_dir, add_bos)
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(model_arch, text.num_hidden_layers)
    for name, tensor in _tensors(hf_dir, text, arch):
        if name.endswith((".weight", ".bias")):
            stem, suffix = name.rsplit(".", 1)
            target = f"{names.get_name(stem)}.{suffix}"
        else:
            target = name  # written under its GGUF name already
        writer.add_tensor(target, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hyperparameters(writer: gguf.GGUFWriter, c, arch: str) -> None:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    if arch == "qwen2moe":
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    elif arch == "phi3":
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        original = rope["original_max_position_embeddings"]
        scale = c.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
    else:  # gemma3: the global layers' rope (llama.cpp keeps the local ones at 10000)
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(c.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])


def _vocabulary(writer: gguf.GGUFWriter, hf_dir: str, add_bos: bool) -> None:
    """The tokenizer as sentencepiece-style ("llama") pieces: ids as the checkpoint's,
    byte-fallback pieces as bytes, the specials as control tokens, the vocabulary's
    unused rows padded; its chat template, if it has one."""
    tok = PreTrainedTokenizerFast.from_pretrained(hf_dir)
    pieces = {i: t for t, i in tok.get_vocab().items()}
    specials = set(tok.all_special_ids)  # the unknown token is typed as such first
    tokens, scores, types = [], [], []
    for i in range(VOCAB):
        piece = pieces.get(i, f"<unused{i}>")
        tokens.append(piece)
        scores.append(-float(i))
        if i not in pieces:
            types.append(gguf.TokenType.UNUSED)
        elif i == tok.unk_token_id:
            types.append(gguf.TokenType.UNKNOWN)
        elif i in specials:
            types.append(gguf.TokenType.CONTROL)
        elif piece.startswith("<0x") and piece.endswith(">"):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_unk_token_id(tok.unk_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(add_bos)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def _tensors(hf_dir: str, c, arch: str):
    """(name, tensor) in the names gguf-py maps (HF's, the experts' without an index),
    or GGUF's own for what HF has no tensor for (Phi-3's LongRoPE factors)."""
    stored = {}
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.startswith("language_model."):  # Gemma 3's text model
                    stored[name.removeprefix("language_model.")] = f.get_tensor(name)
                elif not name.startswith(("vision_tower.", "multi_modal_projector.")):
                    stored[name] = f.get_tensor(name)
    for name, tensor in stored.items():
        if ".experts." in name:
            continue  # stacked below
        if arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor + 1  # Gemma's RMSNorm scales by 1 + weight; llama.cpp's by weight
        if name.endswith("shared_expert_gate.weight"):
            tensor = tensor.flatten()
        yield name, tensor
    if "lm_head.weight" not in stored:  # a tied head, written out as llama.cpp reads it
        yield "lm_head.weight", stored["model.embed_tokens.weight"]
    if arch == "qwen2moe":
        for layer in range(c.num_hidden_layers):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                prefix = f"model.layers.{layer}.mlp.experts"
                experts = [stored[f"{prefix}.{e}.{proj}.weight"] for e in range(c.num_experts)]
                yield f"{prefix}.{proj}.weight", torch.stack(experts)
    if arch == "phi3":
        rope = c.rope_parameters
        factors = {gguf.MODEL_TENSOR.ROPE_FACTORS_LONG: "long_factor"}
        factors[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] = "short_factor"
        for tensor, key in factors.items():
            yield f"{gguf.TENSOR_NAMES[tensor]}.weight", torch.tensor(rope[key])
