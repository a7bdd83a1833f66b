"""Images in a vision model's prompt, on the engine's side: where each image's
placeholder tokens lie, the M-RoPE positions of the prompt, and each step's image rows.

At admission (`ImagePrompt.of`) the n-th run of the image placeholder token pairs with
the request's n-th image; each run must be as long as the processor makes that image
(BadRequestError otherwise, before anything is taken). The runs key the prefix cache's
blocks with the images' digests (engine_api.block_hash.image_key_spans).

Positions (Qwen2-VL's get_rope_index, images only): text counts up one by one; an
image's tokens take (t, h, w) = start + (0, row, column) over its merged grid, and the
text after it goes on from the image's largest position plus one. Past the prompt every
token is its index plus the prompt's `delta` (negative: an image of n tokens spans only
max(rows, columns) positions). A step's rows are positions of the sequence's index, so
chunked prefill and prefix hits (which start a prompt mid-way) read the same table.

Each step (`VisionSteps.step`) the runner gets the step's M-RoPE positions (None where
they equal the plain ones: a text-only step; the 1D positions shifted by the delta where
every row is text) and the tower's output for the image rows it computes, encoded a
whole image at a time through the encoder cache, so a chunk that cuts an image in two
encodes it once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from backend_gpu.encoder_cache import EncoderCache
from backend_gpu.image_processing import Qwen2VLImageProcessor
from backend_gpu.models.qwen2_5_vl import StepImages
from engine_api.block_hash import KeySpan, image_key_spans
from engine_api.errors import BadRequestError
from engine_api.images import ImageInput


@dataclass
class ImageSpan:
    start: int  # the image's placeholder tokens [start, end) in the prompt
    end: int
    image: ImageInput
    grid: tuple[int, int, int]  # the tower's patch grid (t, h, w)


@dataclass
class ImagePrompt:
    spans: list[ImageSpan]
    key_spans: list[KeySpan]  # for the block hashes
    positions: np.ndarray  # int64 [3, prompt length]: M-RoPE positions of the prompt
    delta: int  # rope position - index, past the prompt

    @classmethod
    def of(
        cls,
        token_ids: list[int],
        images: list[ImageInput],
        placeholder: int,
        processor: Qwen2VLImageProcessor,
    ) -> ImagePrompt:
        """The layout of a prompt with `images`; BadRequestError where the placeholders
        do not fit them."""
        keys = image_key_spans(token_ids, placeholder, [im.digest for im in images])
        spans = []
        for (start, end, _), image in zip(keys, images, strict=True):
            if len(image.rgb) != image.width * image.height * 3:  # never at a step
                raise BadRequestError(f"image {len(spans)}: its pixels do not fill its size")
            try:
                grid = processor.grid(image.width, image.height)
            except ValueError as exc:
                raise BadRequestError(str(exc)) from None
            want = grid[0] * grid[1] * grid[2] // processor.merge_size**2
            if end - start != want:
                raise BadRequestError(
                    f"image {len(spans)} ({image.width}x{image.height}) takes {want} "
                    f"placeholder tokens, the prompt has {end - start}"
                )
            spans.append(ImageSpan(start, end, image, grid))
        positions, delta = mrope_positions(len(token_ids), spans, processor.merge_size)
        return cls(spans, keys, positions, delta)

    @property
    def num_image_tokens(self) -> int:
        return sum(s.end - s.start for s in self.spans)

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """The M-RoPE positions [3, end - start] of the sequence's indices [start, end)."""
        length = self.positions.shape[1]
        inside = self.positions[:, min(start, length) : min(end, length)]
        past = np.arange(max(start, length), end, dtype=np.int64) + self.delta
        return np.concatenate([inside, np.broadcast_to(past, (3, past.size))], axis=1)


def mrope_positions(length: int, spans: list[ImageSpan], merge: int) -> tuple[np.ndarray, int]:
    """The prompt's [3, length] positions and the delta that continues them."""
    out = np.empty((3, length), dtype=np.int64)
    index = position = 0
    for span in spans:
        text = span.start - index
        out[:, index : span.start] = np.arange(position, position + text)
        position += text
        t, h, w = span.grid[0], span.grid[1] // merge, span.grid[2] // merge
        grid = np.indices((t, h, w)).reshape(3, -1)
        grid[0] = 0  # an image's frames all sit at its first temporal position
        out[:, span.start : span.end] = grid + position
        position += max(h, w)
        index = span.end
    out[:, index:] = np.arange(position, position + length - index)
    return out, position - index


def image_processor(model_dir: str, max_pixels: int | None) -> Qwen2VLImageProcessor:
    """The model's processor, its largest image capped at `max_pixels` (the engine's
    resize_image_pixels) where that is smaller."""
    processor = Qwen2VLImageProcessor.from_dir(model_dir)
    if max_pixels is None or max_pixels >= processor.max_pixels:
        return processor
    return dataclasses.replace(
        processor, max_pixels=max_pixels, min_pixels=min(processor.min_pixels, max_pixels)
    )


class VisionSteps:
    """Rank 0's: a step's M-RoPE positions and image rows, for a vision model."""

    def __init__(self, model, processor: Qwen2VLImageProcessor, cache_tokens: int) -> None:
        self.model = model
        self.processor = processor
        self.cache = EncoderCache(cache_tokens)

    def step(self, batch) -> tuple[np.ndarray | None, StepImages | None]:
        """(positions [3, T] or None, the image rows or None) of a scheduled batch."""
        pieces: list[np.ndarray] = []
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        offset = 0
        shifted = False
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            layout: ImagePrompt | None = seq.images
            start = seq.num_computed_tokens
            if layout is None:
                pieces.append(np.broadcast_to(np.arange(start, start + n), (3, n)))
            else:
                shifted = True
                pieces.append(layout.rope_positions(start, start + n))
                for span in layout.spans:
                    lo, hi = max(span.start, start), min(span.end, start + n)
                    if lo < hi:
                        out = self.encoded(span, seq.cache_salt)
                        embeds.append(out[lo - span.start : hi - span.start])
                        rows.extend(range(offset + lo - start, offset + hi - start))
            offset += n
        if not shifted:
            return None, None
        images = None
        if rows:
            device = embeds[0].device
            images = StepImages(torch.tensor(rows, device=device), torch.cat(embeds))
        return np.concatenate(pieces, axis=1), images

    def encoded(self, span: ImageSpan, salt: str | None) -> torch.Tensor:
        """The tower's output for one image, from the encoder cache or encoded now."""
        key = (salt, span.image.digest)
        out = self.cache.get(key)
        if out is None:
            image = span.image
            patches = self.processor.patches(image.width, image.height, image.rgb)
            out = self.model.encode_image(torch.from_numpy(patches), span.grid)
            self.cache.put(key, out)
        return out
