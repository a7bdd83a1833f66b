"""Images into a vision tower's input, as the models' HF image processors make it.

Qwen2-VL's (transformers' Qwen2VLImageProcessor, which Qwen2.5-VL uses): the size
rounded to the tower's 28-pixel grid within [min_pixels, max_pixels] (smart_resize), a
bicubic resize, scaled to [0, 1], normalized by the processor's mean and std, then cut
into 14x14 patches with the frame repeated to the temporal patch of 2, in the order the
tower's 2x2 merge reads them.

Gemma 3's (Gemma3ImageProcessor): every image resized (bilinear, the aspect ratio not
kept) to the processor's one size (896x896), rescaled and normalized (mean and std 0.5),
given to the tower whole as [3, height, width]; it always takes mm_tokens_per_image
soft tokens. Pan-and-scan (extra crops of a long image) is off by default there and not
done here: a processor config that turns it on is refused.

Both processors answer the same questions (grid, num_tokens, patches, largest_grid), so
backend_gpu.multimodal lays out and encodes either model's images alike.

The resize is Pillow's (transformers' slow processor resizes through Pillow too, so
the pixels are its own); the rest is numpy. No torchvision: the fast processor needs it,
the engine does not.

The engine sizes an image's placeholder tokens from its width and height alone
(`num_tokens`), before any pixel is touched: the gateway's render and the engine's
check of a prompt agree on that count without decoding anything twice.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image

# OpenAI CLIP's, Qwen2-VL's processor default
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# an aspect ratio past this is refused (transformers' smart_resize refuses it too)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class Qwen2VLImageProcessor:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def from_dir(cls, path: str) -> Qwen2VLImageProcessor:
        """The model directory's preprocessor_config.json (defaults where it has none)."""
        file = os.path.join(path, "preprocessor_config.json")
        if not os.path.exists(file):
            return cls()
        with open(file) as f:
            cfg = json.load(f)
        size = cfg.get("size") or {}
        return cls(
            patch_size=cfg.get("patch_size", 14),
            temporal_patch_size=cfg.get("temporal_patch_size", 2),
            merge_size=cfg.get("merge_size", 2),
            min_pixels=cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56,
            max_pixels=cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280,
            mean=tuple(cfg.get("image_mean", CLIP_MEAN)),
            std=tuple(cfg.get("image_std", CLIP_STD)),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after smart_resize: each a multiple of the factor, the area
        within [min_pixels, max_pixels], the aspect ratio kept as near as that allows."""
        factor = self.factor
        if min(height, width) < 1 or max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(f"image aspect ratio must be at most {MAX_ASPECT_RATIO}")
        h = round(height / factor) * factor
        w = round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return w, h

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) of an image of this size: one frame, two copies."""
        w, h = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def largest_grid(self) -> tuple[int, int, int]:
        """The grid of the largest image it makes (a square at max_pixels): what the
        memory profile encodes once."""
        side = math.isqrt(self.max_pixels)
        return self.grid(side, side)

    def num_tokens(self, width: int, height: int) -> int:
        """The image's placeholder tokens in the prompt: its patches after the merge."""
        t, h, w = self.grid(width, height)
        return t * h * w // (self.merge_size**2)

    def patches(self, width: int, height: int, rgb: bytes) -> np.ndarray:
        """The tower's input, float32 [t*h*w, 3 * temporal_patch * patch * patch]."""
        if len(rgb) != width * height * 3:
            raise ValueError("image bytes are not width * height RGB pixels")
        w, h = self.resized(width, height)
        image = Image.frombytes("RGB", (width, height), rgb)
        if (w, h) != (width, height):
            image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
        # as transformers: rescale in float64, then float32, then normalize
        x = (np.asarray(image).astype(np.float64) * (1 / 255)).astype(np.float32)
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        x = x.transpose(2, 0, 1)[None]  # [frames, C, H, W]
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        x = np.repeat(x, tp, axis=0)  # one frame to a temporal patch
        gt, gh, gw = 1, h // p, w // p
        x = x.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(x.reshape(gt * gh * gw, 3 * tp * p * p))


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    height: int = 896
    width: int = 896
    patch_size: int = 14  # the tower's, from the model's config
    tokens: int = 256  # mm_tokens_per_image, from the model's config
    resample: int = Image.Resampling.BILINEAR
    rescale_factor: float = 1 / 255
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_dir(cls, path: str) -> Gemma3ImageProcessor:
        """The model directory's preprocessor_config.json and config.json (the tower's
        patch and the soft tokens an image takes); defaults where they have none."""
        cfg = _json(os.path.join(path, "preprocessor_config.json"))
        model = _json(os.path.join(path, "config.json"))
        if cfg.get("do_pan_and_scan"):
            raise ValueError("Gemma 3's pan-and-scan (do_pan_and_scan) is not supported")
        size = cfg.get("size") or {}
        return cls(
            height=size.get("height", 896),
            width=size.get("width", 896),
            patch_size=(model.get("vision_config") or {}).get("patch_size", 14),
            tokens=model.get("mm_tokens_per_image", 256),
            resample=cfg.get("resample", Image.Resampling.BILINEAR),
            rescale_factor=cfg.get("rescale_factor", 1 / 255),
            mean=tuple(cfg.get("image_mean", (0.5, 0.5, 0.5))),
            std=tuple(cfg.get("image_std", (0.5, 0.5, 0.5))),
        )

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The tower's patch grid: the same for every image."""
        return 1, self.height // self.patch_size, self.width // self.patch_size

    def largest_grid(self) -> tuple[int, int, int]:
        return self.grid(self.width, self.height)

    def num_tokens(self, width: int, height: int) -> int:
        """An image's soft tokens in the prompt: mm_tokens_per_image, whatever its size."""
        return self.tokens

    def patches(self, width: int, height: int, rgb: bytes) -> np.ndarray:
        """The tower's input, float32 [3, height, width] at the processor's size."""
        if len(rgb) != width * height * 3:
            raise ValueError("image bytes are not width * height RGB pixels")
        image = Image.frombytes("RGB", (width, height), rgb)
        if (width, height) != (self.width, self.height):
            image = image.resize((self.width, self.height), resample=self.resample)
        x = (np.asarray(image).astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.ascontiguousarray(x.transpose(2, 0, 1))


def _json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)
