"""A loaded GGUF model: weights, vocabulary and metadata, through llama.cpp's C API.

The model and its vocabulary are read-only once loaded, so tokenizing from the asyncio
thread while the worker decodes is safe; contexts (the mutable part) belong to the worker.
"""

from __future__ import annotations

import ctypes
import os
from functools import cached_property

import llama_cpp

from backend_local.config import POOLINGS, EngineConfig
from backend_local.errors import ModelLoadError
from backend_local.llama_log import route_llama_log

_GGUF_MAGIC = b"GGUF"
_backend_ready = False


def _init_backend(verbose: bool) -> None:
    global _backend_ready
    # llama.cpp's log goes to the `llama.cpp` logger at its own levels (llama_log.py)
    route_llama_log(verbose)
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _backend_ready = True


def check_gguf_file(path: str) -> None:
    if not os.path.exists(path):
        raise ModelLoadError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise ModelLoadError(f"model path is not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {path}")


class LlamaModel:
    def __init__(self, path: str, verbose: bool = False) -> None:
        check_gguf_file(path)
        _init_backend(verbose)
        params = llama_cpp.llama_model_default_params()
        self.path = path
        self.ptr = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not self.ptr:
            raise ModelLoadError(
                f"llama.cpp could not load the model (corrupt or unsupported?): {path}"
            )
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.ptr)
        self.architecture = self.meta("general.architecture") or "unknown"
        template = llama_cpp.llama_model_chat_template(self.ptr, None)
        self.chat_template = template.decode("utf-8", "replace") if template else None
        self.bos_id = llama_cpp.llama_vocab_bos(self.vocab)
        self.eos_id = llama_cpp.llama_vocab_eos(self.vocab)
        self.bos_text = self.token_text(self.bos_id)
        self.eos_text = self.token_text(self.eos_id)
        self.n_embd = llama_cpp.llama_model_n_embd_out(self.ptr)

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def token_text(self, token: int) -> str:
        """The special-aware text of one token (e.g. '<bos>'); '' for an invalid id."""
        if token < 0:
            return ""
        return self.piece(token, special=True).decode("utf-8", "replace")

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes one token contributes to a text (a UTF-8 character may span tokens)."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        tokens = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(
            self.vocab, data, len(data), tokens, capacity, add_special, parse_special
        )
        if n < 0:
            capacity = -n
            tokens = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), tokens, capacity, add_special, parse_special
            )
        return list(tokens[:n])

    def detokenize(self, token_ids: list[int], special: bool = False) -> str:
        """The ids' text; with `special`, control tokens (<|im_start|>, <bos>) as text."""
        pieces = (self.piece(t, special) for t in token_ids)
        return b"".join(pieces).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    @cached_property
    def eog_ids(self) -> list[int]:
        """Every end-of-generation token; scanned once, only for ignore_eos / min_tokens."""
        return [t for t in range(self.n_vocab) if self.is_eog(t)]

    def own_pooling(self) -> str | None:
        """The pooling the GGUF says its embeddings take (`<arch>.pooling_type`), if it
        names one of POOLINGS (a generator's names none; a reranker's is not one)."""
        value = self.meta(f"{self.architecture}.pooling_type")
        by_type = {t: name for name, t in POOLINGS.items()}
        return by_type.get(int(value)) if value and value.isdigit() else None

    def new_embed_context(self, config: EngineConfig, pooling: str) -> llama_cpp.llama_context_p:
        """A context that pools one input of up to n_ctx_per_seq tokens a decode, as
        llama-server's --embedding does: the whole input in one ubatch (a pooled
        sequence cannot be split), flash attention as llama-server's default picks it."""
        params = llama_cpp.llama_context_default_params()
        length = config.n_ctx_per_seq
        params.n_ctx = params.n_batch = params.n_ubatch = length
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = config.n_threads
        params.embeddings = True
        params.pooling_type = POOLINGS[pooling]
        # llama-server's default; its CPU kernel rounds differently from the plain path
        # (1e-2 apart on Gemma 3's vectors). The cells are cleared before every input, so
        # they are always in position order, where flash attention is exact (new_context).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
        params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(self.ptr, params)
        if not ctx:
            raise ModelLoadError(
                f"llama.cpp could not create an embedding context (n_ctx={length}) for {self.path}"
            )
        return ctx

    def new_context(self, config: EngineConfig) -> llama_cpp.llama_context_p:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = config.n_ctx
        params.n_batch = config.n_batch
        params.n_ubatch = config.n_batch
        params.n_seq_max = config.n_parallel
        params.n_threads = config.n_threads
        params.n_threads_batch = config.n_threads
        # One KV stream per sequence, as llama-server runs: a decode attends over its own
        # stream's cells, not over every cell other sequences hold (in one unified pool, a
        # lone decode beside the cells finished requests left ran at about half speed).
        # A prefix moves between sequences by copying a whole stream (Worker._admit).
        params.kv_unified = False
        # Sliding-window layers keep every cell, so a prefix can be cut at any position.
        params.swa_full = True
        # llama.cpp's CPU flash attention miscomputes a sequence whose cells are not in
        # position order, which reusing a cached prefix produces (new tokens land in holes
        # before the kept cells); the plain attention path is exact there.
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(self.ptr, params)
        if not ctx:
            raise ModelLoadError(
                f"llama.cpp could not create a context (n_ctx={config.n_ctx}, "
                f"n_parallel={config.n_parallel}) for {self.path}"
            )
        return ctx
