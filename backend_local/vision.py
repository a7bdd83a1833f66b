"""Images on the llama.cpp engine: a GGUF's vision projector (`mmproj`) through libmtmd.

llama-cpp-python binds libmtmd (llama_cpp.mtmd_cpp), whose helpers prefill an image into
any sequence of a llama context (`mtmd_helper_eval_chunk_single(..., seq_id, ...)`), so
a prompt's images go into its own sequence of the engine's shared context between the
batched decodes of the others. The pieces:

- `tokenize` (the gateway's render, off the event loop): the chat's text, with
  libmtmd's media marker where each image stood, tokenized by libmtmd as llama-server
  does: its text chunks' ids, and for each image chunk a run of `placeholder` ids as
  long as the image's tokens. That list is the request's prompt (counted, billed,
  bounded by the context like any prompt, its image runs keyed by the images' digests).
- `image_chunk` (the worker, at prefill): one image's chunk, preprocessed by libmtmd,
  checked against its run's length.
- `prefill` (the worker): the chunk encoded by the projector and decoded into the
  sequence at its position; `prefill_next` does both for the images next in a slot's
  prompt (the worker's prefill step, kept here beside libmtmd's calls).

Only models whose image tokens take one position each: libmtmd's M-RoPE models
(Qwen2-VL and its kind) lay an image over fewer positions than tokens, which this
engine's batches (a token's position is its index) cannot express, so they are refused
at start. Calls into libmtmd hold one lock: the render's tokenizing may run in a thread
beside the worker's encoding.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp
from llama_cpp import mtmd_cpp

from backend_local.errors import DecodeError, ModelLoadError
from backend_local.llama_log import route_mtmd_log
from backend_local.model import LlamaModel
from backend_local.slots import Slot
from engine_api.errors import BadRequestError
from engine_api.images import ImageInput
from engine_api.throughput import Throughput

# a vocabulary's own image token, where it has one, stands for an image's tokens in the
# prompt's ids (Gemma 3, Qwen-VL, LLaVA, Pixtral); else the vocabulary's last id
IMAGE_TOKENS = ("<image_soft_token>", "<|image_pad|>", "<image>", "[IMG]")


class Vision:
    """A model's projector, loaded with libmtmd on the text model."""

    def __init__(self, model: LlamaModel, path: str, n_threads: int) -> None:
        if not os.path.isfile(path):
            raise ModelLoadError(f"mmproj: no such file: {path}")
        route_mtmd_log()
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = n_threads
        params.warmup = False
        # the projector's attention as the engine's context runs its own (model.py)
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = mtmd_cpp.mtmd_init_from_file(path.encode(), model.ptr, params)
        if not self.ctx:
            raise ModelLoadError(
                f"mmproj: libmtmd could not load the projector {path} for {model.path} "
                "(not an mmproj GGUF, or made for another model)"
            )
        try:
            if not mtmd_cpp.mtmd_support_vision(self.ctx):
                raise ModelLoadError(f"mmproj: {path} has no vision encoder (audio only?)")
            if mtmd_cpp.mtmd_decode_use_mrope(self.ctx):
                raise ModelLoadError(
                    f"mmproj: {path} is an M-RoPE model's projector (Qwen2-VL and its kind): "
                    "its image tokens share positions, which this engine's batches do not "
                    "express; serve it on the gpu backend"
                )
        except BaseException:
            self.close()
            raise
        self.marker = mtmd_cpp.mtmd_default_marker().decode()
        self.placeholder = _placeholder(model)
        self._lock = threading.Lock()

    def close(self) -> None:
        if self.ctx:
            mtmd_cpp.mtmd_free(self.ctx)
            self.ctx = None

    def tokenize(self, text: str, images: list[ImageInput], add_special: bool) -> list[int]:
        """The prompt's ids: `text`'s (each marker an image, in order) as libmtmd
        tokenizes it, each image as a run of `placeholder`; BadRequestError when the
        markers and the images do not pair up, the text holds the placeholder token, or
        the prompt ends in an image (its last token's logits start the answer)."""
        ids: list[int] = []
        last_is_text = False
        with self._chunks(text, images, add_special) as chunks:
            for chunk in chunks:
                if mtmd_cpp.mtmd_input_chunk_get_type(chunk) == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    tokens = mtmd_cpp.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    text_ids = tokens[: n.value]
                    if self.placeholder in text_ids:
                        raise BadRequestError(
                            f"the prompt's text holds the image placeholder token "
                            f"{self.placeholder} of this model; it stands for images only"
                        )
                    ids += text_ids
                    last_is_text = last_is_text or bool(text_ids)
                else:
                    ids += [self.placeholder] * mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk)
                    last_is_text = False
        if not last_is_text:
            raise BadRequestError("the prompt must end in text after its last image")
        return ids

    def image_chunk(self, image: ImageInput, n_tokens: int, n_batch: int) -> int:
        """The image's chunk, preprocessed (the caller frees it with `free_chunk`);
        BadRequestError when it is not `n_tokens` tokens (its placeholder run's), or
        when its tokens attend both ways (Gemma 3's) and do not fit one batch."""
        with self._chunks(self.marker, [image], False) as chunks:
            chunk = next(
                c
                for c in chunks
                if mtmd_cpp.mtmd_input_chunk_get_type(c) == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_IMAGE
            )
            found = mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk)
            if found != n_tokens:
                raise BadRequestError(
                    f"an image of {image.width}x{image.height} is {found} tokens here, "
                    f"but its placeholder run in the prompt is {n_tokens}"
                )
            if found > n_batch and mtmd_cpp.mtmd_decode_use_non_causal(self.ctx, chunk):
                raise BadRequestError(
                    f"an image is {found} tokens that attend to each other, more than one "
                    f"batch of this engine holds (n_batch {n_batch}): raise the entry's n_batch"
                )
            return mtmd_cpp.mtmd_input_chunk_copy(chunk)

    @staticmethod
    def free_chunk(chunk: int) -> None:
        mtmd_cpp.mtmd_input_chunk_free(chunk)

    def prefill(self, lctx, chunk: int, n_past: int, seq_id: int, n_batch: int) -> int:
        """Encode the image chunk and decode it into sequence `seq_id` from position
        `n_past` (its tokens attend both ways where the model's do); llama.cpp's status
        (0: done)."""
        new_n_past = llama_cpp.llama_pos(0)
        with self._lock:
            rc = mtmd_cpp.mtmd_helper_eval_chunk_single(
                self.ctx, lctx, chunk, n_past, seq_id, n_batch, False, ctypes.byref(new_n_past)
            )
        if rc == 0 and new_n_past.value != n_past + mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk):
            return -1  # positions past its tokens: an M-RoPE chunk, refused at load
        return rc

    def prefill_next(self, lctx, slot: Slot, n_batch: int, throughput: Throughput) -> None:
        """Prefill the images that come next in the slot's prompt, each into its
        sequence by itself, its run's ids then in the slot's cells; BadRequestError (an
        image libmtmd cannot take as its run says) or DecodeError (its prefill failed),
        for the worker to end the request with."""
        request = slot.request
        for (start, end, _), image in zip(request.spans, request.images, strict=True):
            if start != len(slot.cached):
                continue
            chunk = self.image_chunk(image, end - start, n_batch)
            try:
                rc = self.prefill(lctx, chunk, start, slot.seq_id, n_batch)
            finally:
                self.free_chunk(chunk)
            if rc != 0:
                raise DecodeError(f"libmtmd failed with status {rc} on an image")
            slot.cached.extend(request.prompt[start:end])
            throughput.record(end - start, 0)
            if request.progress is not None:
                request.progress.advance(len(slot.cached), slot.reused)

    @contextmanager
    def _chunks(self, text: str, images: list[ImageInput], add_special: bool) -> Iterator[list]:
        """libmtmd's chunks of `text` with `images` (freed on leaving)."""
        bitmaps = []
        chunks = mtmd_cpp.mtmd_input_chunks_init()
        try:
            for image in images:
                pixels = (ctypes.c_uint8 * len(image.rgb)).from_buffer_copy(image.rgb)
                bitmap = mtmd_cpp.mtmd_bitmap_init(image.width, image.height, pixels)
                if not bitmap:
                    raise BadRequestError(
                        f"libmtmd refused an image of {image.width}x{image.height}"
                    )
                bitmaps.append(bitmap)
                mtmd_cpp.mtmd_bitmap_set_id(bitmap, image.digest.encode())
            data = text.encode()
            inp = mtmd_cpp.mtmd_input_text()
            inp.text, inp.text_len = data, len(data)
            inp.add_special, inp.parse_special = add_special, True
            array = (mtmd_cpp.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
            with self._lock:
                rc = mtmd_cpp.mtmd_tokenize(
                    self.ctx, chunks, ctypes.byref(inp), array, len(bitmaps)
                )
            if rc == 1:
                raise BadRequestError(
                    f"the prompt has {text.count(self.marker)} image markers for {len(images)} "
                    f"images (its text must not contain {self.marker})"
                )
            if rc != 0:
                raise BadRequestError(f"libmtmd could not preprocess the images (status {rc})")
            count = mtmd_cpp.mtmd_input_chunks_size(chunks)
            yield [mtmd_cpp.mtmd_input_chunks_get(chunks, i) for i in range(count)]
        finally:
            mtmd_cpp.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd_cpp.mtmd_bitmap_free(bitmap)


def _placeholder(model: LlamaModel) -> int:
    """The id that stands for an image's tokens: the vocabulary's own image token (one
    special token of a known name), else its last id."""
    for name in IMAGE_TOKENS:
        ids = model.tokenize(name, add_special=False, parse_special=True)
        if len(ids) == 1 and model.token_text(ids[0]) == name:
            return ids[0]
    return model.n_vocab - 1
