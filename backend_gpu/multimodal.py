"""Images in a vision model's prompt, on the engine's side: where each image's
placeholder tokens lie, the M-RoPE positions of the prompt (Qwen2.5-VL), which rows see
ahead (Gemma 3), and each step's image rows. The models differ in these three ways only;
preprocessing (backend_gpu.image_processing), the encoder cache and the block keys are
shared.

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

Bidirectional images (Gemma 3: an image's soft tokens attend to each other both ways):
a step's image rows see up to their image's last token (`key_last`, the paged
attention's mask), so an image's tokens must all be computed in the step that computes
any of them: `chunk_end` keeps a prefill chunk from ending inside an image (it ends
before the image, or the sequence waits for a budget that takes the image whole). A
prefix-cache hit may end inside an image: its cached keys were computed with the whole
image in view (the blocks' keys carry the image's digest), and the rest of the image,
computed in one chunk, sees them as earlier keys.

Each step (`VisionSteps.step`) the runner gets the step's M-RoPE positions (None where
they equal the plain ones: a text-only step or a model without M-RoPE; the 1D positions
shifted by the delta where every row is text), the rows that see ahead, and the tower's
output for the image rows it computes, encoded a whole image at a time through the
encoder cache, so a chunk that cuts an image in two encodes it once.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from backend_gpu.config import EngineConfig
from backend_gpu.encoder_cache import EncoderCache
from backend_gpu.image_processing import Gemma3ImageProcessor, Qwen2VLImageProcessor
from backend_gpu.models import ARCHITECTURES
from backend_gpu.models.qwen2_5_vl import StepImages
from engine_api.block_hash import KeySpan, image_key_spans
from engine_api.errors import BadRequestError
from engine_api.images import ImageInput

log = logging.getLogger(__name__)


class ImageProcessor(Protocol):
    """What the engine asks of a model's image processor (backend_gpu.image_processing)."""

    def grid(self, width: int, height: int) -> tuple[int, int, int]: ...

    def largest_grid(self) -> tuple[int, int, int]: ...

    def num_tokens(self, width: int, height: int) -> int: ...

    def patches(self, width: int, height: int, rgb: bytes) -> np.ndarray: ...


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
    positions: np.ndarray | None  # int64 [3, prompt length]: M-RoPE positions; None: plain
    delta: int  # rope position - index, past the prompt
    whole: bool = False  # an image's tokens see each other: computed in one chunk

    @classmethod
    def of(
        cls,
        token_ids: list[int],
        images: list[ImageInput],
        placeholder: int,
        processor: ImageProcessor,
        merge: int | None = None,
        whole: bool = False,
    ) -> ImagePrompt:
        """The layout of a prompt with `images`; BadRequestError where the placeholders
        do not fit them. `merge`: an M-RoPE model's spatial merge (None: plain
        positions); `whole`: its images attend both ways (Gemma 3's)."""
        keys = image_key_spans(token_ids, placeholder, [im.digest for im in images])
        spans = []
        for (start, end, _), image in zip(keys, images, strict=True):
            if len(image.rgb) != image.width * image.height * 3:  # never at a step
                raise BadRequestError(f"image {len(spans)}: its pixels do not fill its size")
            try:
                grid = processor.grid(image.width, image.height)
            except ValueError as exc:
                raise BadRequestError(str(exc)) from None
            want = processor.num_tokens(image.width, image.height)
            if end - start != want:
                raise BadRequestError(
                    f"image {len(spans)} ({image.width}x{image.height}) takes {want} "
                    f"placeholder tokens, the prompt has {end - start}"
                )
            spans.append(ImageSpan(start, end, image, grid))
        if merge is None:
            return cls(spans, keys, None, 0, whole)
        positions, delta = mrope_positions(len(token_ids), spans, merge)
        return cls(spans, keys, positions, delta, whole)

    @property
    def num_image_tokens(self) -> int:
        return sum(s.end - s.start for s in self.spans)

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """The M-RoPE positions [3, end - start] of the sequence's indices [start, end)."""
        assert self.positions is not None
        length = self.positions.shape[1]
        inside = self.positions[:, min(start, length) : min(end, length)]
        past = np.arange(max(start, length), end, dtype=np.int64) + self.delta
        return np.concatenate([inside, np.broadcast_to(past, (3, past.size))], axis=1)

    def chunk_end(self, start: int, end: int) -> int:
        """Where a chunk of the sequence's indices from `start` may end, at most `end`:
        never inside an image whose tokens see each other (back to the image's start,
        or `start` itself: nothing this step, the image waits for a larger budget)."""
        if self.whole:
            for span in self.spans:
                if span.start < end < span.end:
                    return max(start, span.start)
        return end

    def key_last(self, start: int, end: int) -> np.ndarray | None:
        """Per index of [start, end), the last index it attends to: itself, or for an
        image's token (where they see each other) the image's last; None: all causal."""
        if not self.whole or not any(s.start < end and start < s.end - 1 for s in self.spans):
            return None
        last = np.arange(start, end, dtype=np.int64)
        for span in self.spans:
            lo, hi = max(span.start, start), min(span.end, end)
            last[lo - start : hi - start] = span.end - 1
        return last


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


def check_vision_settings(config: EngineConfig, hf_config) -> None:
    """A vision model runs whole in one process for now: under a setting its images
    cannot go with, one that can serve its text alone does (Gemma 3's: `text_model`,
    hf_config's architecture set to it, so every rank builds that), another is a
    ValueError naming the setting, before any process starts. A model whose images
    are computed whole (Gemma 3's) needs a step budget that takes one."""
    architecture = (hf_config.architectures or [hf_config.model_type])[0]
    cls = ARCHITECTURES.get(architecture)
    if not getattr(cls, "vision", False):
        return
    sizes = ("tensor_parallel_size", "pipeline_parallel_size")
    blocking = [name for name in sizes if getattr(config, name) > 1]
    if config.speculative_config is not None:
        blocking.append("speculative_config")
    if config.enable_lora and not cls.supports_lora:
        blocking.append("enable_lora")
    text = getattr(cls, "text_model", None)
    if blocking and text is not None:
        log.warning("%s: %s serves text only (no images)", ", ".join(blocking), architecture)
        hf_config.architectures = [text]
        return
    for name in blocking:
        if name == "enable_lora":  # the runner refuses it naming the model
            continue
        what = f"{name} > 1" if name.endswith("_size") else name
        raise ValueError(f"{what} does not work with vision models yet")
    tokens = getattr(hf_config, "mm_tokens_per_image", 0)
    whole = getattr(cls, "bidirectional_images", False) and config.enable_chunked_prefill
    if whole and config.max_num_batched_tokens < tokens:
        raise ValueError(
            f"max_num_batched_tokens {config.max_num_batched_tokens} is below an "
            f"image's {tokens} tokens, which are computed in one step"
        )


def image_processor(model, model_dir: str, max_pixels: int | None) -> ImageProcessor:
    """The model's processor: Qwen2-VL's (M-RoPE models), its largest image capped at
    `max_pixels` (the engine's max_image_pixels) where that is smaller; Gemma 3's, whose
    images are all resized to one size (max_pixels leaves them as they are)."""
    if not getattr(model, "mrope", False):
        return Gemma3ImageProcessor.from_dir(model_dir)
    processor = Qwen2VLImageProcessor.from_dir(model_dir)
    if max_pixels is None or max_pixels >= processor.max_pixels:
        return processor
    return dataclasses.replace(
        processor, max_pixels=max_pixels, min_pixels=min(processor.min_pixels, max_pixels)
    )


@dataclass(frozen=True)
class ImageMarkers:
    """How a chat's image part enters the prompt's text (the gateway's render,
    gateway.backends.vision_render): `marker` where the image stands, before the chat
    template; what the template's text has the marker become before it is tokenized
    (`expansion`; None: as it is), as the model's HF processor does; then the one `pad`
    token of each is widened to the image's token count."""

    marker: str
    pad: str
    expansion: str | None = None

    def expand(self, text: str) -> str:
        return text if self.expansion is None else text.replace(self.marker, self.expansion)


def image_markers(model, hf_config, tokenizer) -> ImageMarkers:
    """Qwen2.5-VL's <|vision_start|><|image_pad|><|vision_end|>; Gemma 3's
    <start_of_image>, which its processor writes as "\n\n", itself, the soft tokens,
    <end_of_image>, "\n\n" (Gemma3Processor.full_image_sequence)."""
    name = tokenizer.convert_ids_to_tokens
    pad = name(hf_config.image_token_id)
    if getattr(model, "mrope", False):
        start, end = name(hf_config.vision_start_token_id), name(hf_config.vision_end_token_id)
        return ImageMarkers(start + pad + end, pad)
    boi, eoi = name(hf_config.boi_token_id), name(hf_config.eoi_token_id)
    return ImageMarkers(boi, pad, f"\n\n{boi}{pad}{eoi}\n\n")


@dataclass
class StepVision:
    """A step's vision inputs, for the runner."""

    positions: np.ndarray | None  # M-RoPE positions [3, T]; None: the plain ones
    images: StepImages | None  # the image rows' embeddings
    key_last: np.ndarray | None  # per row, the last key index it sees; None: causal


class VisionSteps:
    """Rank 0's: a step's positions, image rows and rows that see ahead, for a vision model."""

    def __init__(
        self,
        model,
        processor: ImageProcessor,
        cache_tokens: int,
        markers: ImageMarkers | None = None,
    ) -> None:
        self.model = model
        self.processor = processor
        self.markers = markers  # for the gateway's render of a chat's images
        self.cache = EncoderCache(cache_tokens)
        self.mrope = getattr(model, "mrope", False)
        self.whole = getattr(model, "bidirectional_images", False)

    def layout(self, token_ids: list[int], images: list[ImageInput], placeholder: int):
        """The prompt's ImagePrompt (BadRequestError where it does not fit its images)."""
        merge = self.processor.merge_size if self.mrope else None
        return ImagePrompt.of(token_ids, images, placeholder, self.processor, merge, self.whole)

    def step(self, batch) -> StepVision:
        """The vision inputs of a scheduled batch."""
        pieces: list[np.ndarray] = []
        lasts: list[np.ndarray] = []
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        offset = 0
        shifted = ahead = False
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            layout: ImagePrompt | None = seq.images
            start = seq.num_computed_tokens
            plain = np.arange(start, start + n)
            last = layout.key_last(start, start + n) if layout is not None else None
            ahead |= last is not None
            lasts.append(plain if last is None else last)
            if layout is None or layout.positions is None:
                pieces.append(np.broadcast_to(plain, (3, n)))
            else:
                shifted = True
                pieces.append(layout.rope_positions(start, start + n))
            for span in layout.spans if layout is not None else ():
                lo, hi = max(span.start, start), min(span.end, start + n)
                if lo < hi:
                    out = self.encoded(span, seq.cache_salt)
                    embeds.append(out[lo - span.start : hi - span.start])
                    rows.extend(range(offset + lo - start, offset + hi - start))
            offset += n
        images = None
        if rows:
            device = embeds[0].device
            images = StepImages(torch.tensor(rows, device=device), torch.cat(embeds))
        return StepVision(
            np.concatenate(pieces, axis=1) if shifted else None,
            images,
            np.concatenate(lasts) if ahead else None,
        )

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
