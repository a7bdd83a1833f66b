"""A tiny seeded random Gemma 3 with its vision (Gemma3ForConditionalGeneration: a SigLIP
tower of 2 layers over 64x64 images in 8x8 patches, pooled 2x2 to 16 soft tokens; a
3-layer text model whose sliding layers' window of 8 is shorter than an image; weights
spread so that greedy output follows the image) saved like
a hub checkpoint, with its tokenizer (the tiny models' BPE plus Gemma's image tokens and
a Gemma 3 chat template that writes an image part as <start_of_image>) and a processor
config of that size."""

from __future__ import annotations

import json
import os

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from tests.backend_gpu.tiny_models import VOCAB, build_tokenizer

IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
SIZE = 64  # the processor's (and the tower's) image side
TOKENS_PER_IMAGE = 16
# Gemma 3's template's shape: list content with image parts as <start_of_image>
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if m.content is string %}{{ m.content | trim }}{% else %}"
    "{% for item in m.content %}{% if item.type == 'image' %}<start_of_image>"
    "{% elif item.type == 'text' %}{{ item.text | trim }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def tiny_config(ids: dict[str, int]) -> Gemma3Config:
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=16,
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIZE,
        patch_size=8,
        vision_use_head=False,
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=ids["<image_soft_token>"],
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        initializer_range=0.2,
    )


def save_tiny_gemma3_vision(directory: str) -> str:
    path = os.path.join(directory, "tiny-gemma3-vision")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS}
    assert max(ids.values()) < VOCAB
    torch.manual_seed(0)
    config = tiny_config(ids)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    model = Gemma3ForConditionalGeneration(config).float()
    # transformers starts the projection at 0 (no image would show) and Gemma's norms at
    # a scale of 1: spread, with small embeddings, the output follows the prompt and the
    # image (greedy repeats one token otherwise)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.0)
        for name, param in model.model.language_model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": SIZE, "width": SIZE},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        "rescale_factor": 1 / 255,
        "do_pan_and_scan": False,
    }
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f)
    return path


def hf_image_processor(size: int = SIZE):
    """transformers' Gemma 3 image processor without torchvision: its Pillow backend
    (transformers 5.2x), or the slow processor of the versions before it."""
    try:
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil as Processor,
        )
    except ImportError:
        from transformers import Gemma3ImageProcessor as Processor
    return Processor(
        size={"height": size, "width": size},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        resample=2,
        do_pan_and_scan=False,
    )
