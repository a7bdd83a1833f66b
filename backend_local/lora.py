"""LoRA adapters for the llama.cpp engine: GGUF LoRA files (llama.cpp's own format, as
convert_lora_to_gguf.py writes them), checked, loaded on demand and kept loaded up to
`max_loras`, least recently used out.

llama.cpp applies adapters to a whole context, not to a sequence: every token of a
decode runs under the context's one adapter set. So, as llama-server does, a step
decodes the sequences of one adapter (or of the base model) only (lora_groups.py).

A request's adapter is its name and path together (AdapterRef); its cells and blocks
are keyed by that (engine_api.block_hash.adapter_root), never shared with another
adapter or the base model.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import OrderedDict
from typing import Any

import llama_cpp

from backend_local.gguf_header import read_strings
from backend_local.model import LlamaModel
from engine_api.errors import BadRequestError, EngineDeadError
from engine_api.records import AdapterRef

GroupKey = tuple[str, str] | None  # an adapter's (name, path); None: the base model


def group_key(adapter: AdapterRef | None) -> GroupKey:
    return None if adapter is None else (adapter.name, adapter.path)


def peft_hint(path: str) -> str:
    return (
        f"{path} is a PEFT adapter (adapter_config.json, safetensors); the llama.cpp "
        "backend serves GGUF LoRA files: convert it with llama.cpp's "
        f"`python convert_lora_to_gguf.py --base BASE_MODEL_HF_DIR --outfile adapter.gguf {path}`"
    )


def check_adapter_file(path: str, architecture: str) -> None:
    """Raise BadRequestError naming why `path` is not a GGUF LoRA adapter for a model of
    `architecture`: no such file, a PEFT directory (with how to convert it), not GGUF,
    a model rather than an adapter, another kind of adapter, another architecture."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "adapter_config.json")):
            raise BadRequestError(peft_hint(path))
        raise BadRequestError(f"adapter path {path} is a directory, not a GGUF LoRA file")
    if not os.path.isfile(path):
        raise BadRequestError(f"adapter file not found: {path}")
    keys = {"general.type", "adapter.type", "general.architecture"}
    try:
        fields = read_strings(path, keys)
    except ValueError as exc:
        hint = (
            f" ({peft_hint(os.path.dirname(path) or '.')})" if path.endswith(".safetensors") else ""
        )
        raise BadRequestError(f"adapter {path}: {exc}{hint}") from exc
    except OSError as exc:
        raise BadRequestError(f"adapter {path} cannot be read: {exc.strerror}") from exc
    kind = fields.get("general.type", "model")
    if kind != "adapter":
        raise BadRequestError(f"{path} is a GGUF {kind}, not an adapter (general.type)")
    lora = fields.get("adapter.type")
    if lora != "lora":
        raise BadRequestError(f"{path} is a {lora or 'untyped'} adapter, not a LoRA (adapter.type)")
    arch = fields.get("general.architecture")
    if arch != architecture:
        raise BadRequestError(
            f"adapter {path} is for a {arch} model; this model's architecture is {architecture}"
        )


class AdapterCache:
    """The adapters loaded on the model, least recently used first, and the context's
    current one. Loads, applies and frees run on the worker thread; `check` may run on
    any thread (it loads a copy of its own and frees it); `names` on any."""

    def __init__(self, model: LlamaModel, ctx: llama_cpp.llama_context_p, max_loras: int):
        self.model = model
        self.ctx = ctx
        self.max_loras = max_loras
        self.loads = 0  # adapters loaded for requests so far
        self._loaded: OrderedDict[tuple[str, str], Any] = OrderedDict()  # key: llama_adapter_lora_p
        self._current: GroupKey = None  # the adapter set on the context
        # llama.cpp's load and free both change the model's set of adapters; `names`
        # reads `_loaded` from other threads
        self._lock = threading.Lock()
        self._closed = False

    def _init(self, ref: AdapterRef) -> Any:
        """Load `ref` onto the model (holding the lock); BadRequestError if llama.cpp cannot."""
        if self._closed:
            raise EngineDeadError("the llama.cpp engine is shut down")
        ptr = llama_cpp.llama_adapter_lora_init(self.model.ptr, ref.path.encode())
        if not ptr:
            raise BadRequestError(
                f"llama.cpp could not load adapter {ref.name!r} from {ref.path}: its tensors "
                "do not fit this model (another base model's shapes?)"
            )
        return ptr

    def check(self, ref: AdapterRef) -> None:
        """Raise BadRequestError naming what is wrong with `ref` for this model."""
        check_adapter_file(ref.path, self.model.architecture)
        with self._lock:
            llama_cpp.llama_adapter_lora_free(self._init(ref))

    def acquire(self, ref: AdapterRef) -> None:
        """Have `ref` loaded (most recently used now); BadRequestError if it cannot be."""
        key = (ref.name, ref.path)
        if key in self._loaded:
            with self._lock:
                self._loaded.move_to_end(key)
            return
        check_adapter_file(ref.path, self.model.architecture)
        with self._lock:
            self._loaded[key] = self._init(ref)
        self.loads += 1

    def apply(self, key: GroupKey) -> None:
        """Run the context's next decode under adapter `key` (loaded), or the base model."""
        if key == self._current:
            return
        if key is None:
            rc = llama_cpp.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self._loaded[key])
            rc = llama_cpp.llama_set_adapters_lora(self.ctx, adapters, 1, (ctypes.c_float * 1)(1))
        if rc != 0:
            raise RuntimeError(f"llama_set_adapters_lora failed with status {rc}")
        self._current = key

    def trim(self, in_use: set[GroupKey]) -> None:
        """Free the least recently used adapters past max_loras that no request uses."""
        for key in list(self._loaded):
            if len(self._loaded) <= self.max_loras:
                return
            if key not in in_use:
                self._free(key)

    def remove(self, name: str, in_use: set[GroupKey]) -> bool:
        """Free the adapters named `name`; False while a request still uses one."""
        keys = [k for k in self._loaded if k[0] == name]
        if any(k in in_use for k in keys):
            return False
        for key in keys:
            self._free(key)
        return True

    def _free(self, key: tuple[str, str]) -> None:
        if key == self._current:  # the context must not keep a freed adapter
            self.apply(None)
        with self._lock:
            llama_cpp.llama_adapter_lora_free(self._loaded.pop(key))

    def names(self) -> list[str]:
        with self._lock:
            return [name for name, _ in self._loaded]

    def close(self) -> None:
        """Free every adapter (the context is gone); later checks fail."""
        with self._lock:
            self._closed = True
            for ptr in self._loaded.values():
                llama_cpp.llama_adapter_lora_free(ptr)
            self._loaded.clear()
