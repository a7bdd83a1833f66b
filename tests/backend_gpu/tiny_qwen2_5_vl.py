"""A tiny seeded random Qwen2.5-VL (vision tower of 3 blocks, one of them full attention,
windows of 2x2 merged tokens; a 2-layer decoder with M-RoPE) saved like a hub checkpoint
with its tokenizer (the tiny models' BPE plus Qwen's vision tokens) and a processor
config of small images, and real-looking images drawn with Pillow to feed it."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from engine_api.images import ImageInput, image_input
from tests.backend_gpu.tiny_models import VOCAB, build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
# the processor's bounds: small images, so that a test's prompts stay short
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 24


def tiny_config(token_ids: dict[str, int]) -> Qwen2_5_VLConfig:
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,  # 2x2 merged tokens a window
        fullatt_block_indexes=[1],
        initializer_range=0.2,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids["<|image_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def save_tiny_qwen2_5_vl(directory: str) -> str:
    path = os.path.join(directory, "tiny-qwen2_5_vl")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    assert max(ids.values()) < VOCAB
    torch.manual_seed(0)
    config = tiny_config(ids)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f)
    return path


def hf_image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """transformers' Qwen2-VL image processor without torchvision: its Pillow backend
    (transformers 5.2x), or the slow processor of the versions before it."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Processor,
        )
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Processor
    return Processor(min_pixels=min_pixels, max_pixels=max_pixels)


def scene(width: int, height: int, seed: int) -> Image.Image:
    """A drawn picture: a sky gradient, a sun, hills, a house and a blur, so that the
    resize sees edges, gradients and texture as in a photograph."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height)[:, None, None]
    top, bottom = rng.uniform(80, 200, 3), rng.uniform(150, 255, 3)
    sky = (top * (1 - y) + bottom * y).repeat(width, axis=1)
    image = Image.fromarray(sky.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    r = min(width, height) // 6
    cx, cy = int(rng.uniform(r, width - r)), int(rng.uniform(r, height / 2))
    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(255, 220, 60))
    for i in range(3):
        base = int(height * (0.55 + 0.12 * i))
        points = [(0, height), (0, base)]
        points += [(x, base + int(rng.normal(0, height / 20))) for x in range(0, width, 9)]
        points += [(width, base), (width, height)]
        draw.polygon(points, fill=tuple(int(v) for v in rng.uniform(20, 140, 3)))
    hx, hy = width // 3, int(height * 0.5)
    draw.rectangle((hx, hy, hx + width // 4, hy + height // 4), fill=(170, 60, 40))
    draw.polygon(
        [(hx - 4, hy), (hx + width // 8, hy - height // 6), (hx + width // 4 + 4, hy)],
        fill=(90, 40, 30),
    )
    noise = rng.normal(0, 12, (height, width, 3))
    pixels = np.clip(np.asarray(image, dtype=np.float64) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB").filter(ImageFilter.SMOOTH)


def scene_input(width: int, height: int, seed: int) -> ImageInput:
    return image_input(width, height, scene(width, height, seed).tobytes())
