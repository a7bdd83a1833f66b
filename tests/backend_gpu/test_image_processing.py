"""The engine's image preprocessing equals transformers' Qwen2-VL image processor (its
Pillow backend, which needs no torchvision): the same grid and the same patches, bit for
bit, on photographs (scikit-learn's sample photos) and drawn scenes, downscaled past
max_pixels, upscaled to min_pixels and rounded to the 28-pixel grid; token counts from
the size alone agree with the patches."""

from __future__ import annotations

from importlib import resources

import numpy as np
import pytest
from PIL import Image

from backend_gpu.image_processing import Qwen2VLImageProcessor
from tests.backend_gpu.tiny_qwen2_5_vl import hf_image_processor, scene

BOUNDS = [(28 * 28 * 4, 28 * 28 * 24), (56 * 56, 28 * 28 * 1280)]


def photo(name: str) -> Image.Image:
    with resources.as_file(resources.files("sklearn.datasets") / "images" / name) as path:
        return Image.open(path).convert("RGB")


IMAGES = {
    "china.jpg": lambda: photo("china.jpg"),  # 640x427
    "flower.jpg-crop": lambda: photo("flower.jpg").crop((37, 11, 330, 190)),
    "scene-300x200": lambda: scene(300, 200, 1),
    "scene-31x97": lambda: scene(31, 97, 2),  # below min_pixels: scaled up
    "scene-50x50": lambda: scene(50, 50, 3),
}


@pytest.mark.parametrize("bounds", BOUNDS, ids=["tiny-bounds", "qwen-defaults"])
@pytest.mark.parametrize("name", list(IMAGES))
def test_patches_equal_transformers(name, bounds):
    image = IMAGES[name]()
    lo, hi = bounds
    ours = Qwen2VLImageProcessor(min_pixels=lo, max_pixels=hi)
    ref = hf_image_processor(lo, hi)(images=[image], return_tensors="np")
    width, height = image.size
    patches = ours.patches(width, height, image.tobytes())
    assert list(ref["image_grid_thw"][0]) == list(ours.grid(width, height))
    assert patches.dtype == np.float32
    np.testing.assert_array_equal(patches, ref["pixel_values"])
    t, h, w = ours.grid(width, height)
    assert ours.num_tokens(width, height) == t * h * w // 4 == patches.shape[0] // 4


def test_the_model_directory_sets_the_bounds(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"size": {"shortest_edge": 3136, "longest_edge": 50176}, "merge_size": 2}'
    )
    processor = Qwen2VLImageProcessor.from_dir(str(tmp_path))
    assert (processor.min_pixels, processor.max_pixels) == (3136, 50176)
    # 640x427 is past 50176 pixels: scaled down to the 28 grid within it
    w, h = processor.resized(640, 427)
    assert w % 28 == h % 28 == 0 and w * h <= 50176


def test_refuses_what_it_cannot_process():
    processor = Qwen2VLImageProcessor()
    with pytest.raises(ValueError, match="aspect ratio"):
        processor.grid(2010, 10)
    with pytest.raises(ValueError, match="RGB"):
        processor.patches(10, 10, b"\0" * 299)
