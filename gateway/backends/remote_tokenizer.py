"""The model's tokenizer on the gateway's side, for upstreams that cannot tokenize for it
(llama-cpp-python's server, llama.cpp's llama-server): `options.tokenizer`, an HF
tokenizer directory or a GGUF file.

The gateway needs token ids before it picks a replica (quotas, context checks, prefix
hashes), and when the upstream sends no usage it counts the completion itself. An
upstream that takes only text gets back the text the ids were rendered from (remembered
per prompt), so it tokenizes exactly what the client sent. transformers converts a GGUF
file's vocabulary slowly (tens of seconds for Gemma's 262k tokens), so the converted
tokenizer is cached on disk; the architecture (for a built-in chat template) is read
from the GGUF header, not by parsing the whole file again.
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import os
import shutil
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

from engine_api.records import PromptInput
from gateway.backends.common import render_prompt

PROMPT_TEXTS = 512  # the texts of the most recently rendered prompts are remembered
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_load_lock = threading.Lock()


class RemoteTokenizer:
    """A transformers tokenizer with the model's chat template or built-in turn format.
    Thread-safe: large prompts are rendered in worker threads."""

    def __init__(self, tokenizer: Any, architecture: str) -> None:
        self.tokenizer = tokenizer
        self.architecture = "gemma3" if architecture == "gemma3_text" else architecture
        self.bos_token: str = tokenizer.bos_token or ""
        self._texts: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    def render(
        self,
        prompt: PromptInput,
        tools: list[dict] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a prompt or chat (with the template's variables `kwargs`), as the
        in-process adapters render them."""
        texts: list[str] = []

        def encode(text: str, add_bos: bool) -> list[int]:
            texts.append(text)
            return self.tokenizer.encode(text, add_special_tokens=add_bos)

        template, eos = self.tokenizer.chat_template, self.tokenizer.eos_token or ""
        ids = render_prompt(
            prompt,
            encode,
            template,
            self.architecture,
            self.bos_token,
            eos,
            tools,
            template_kwargs=kwargs,
        )
        if texts:
            with self._lock:
                key = _key(ids)
                self._texts[key] = texts[0]
                self._texts.move_to_end(key)
                while len(self._texts) > PROMPT_TEXTS:
                    self._texts.popitem(last=False)
        return ids

    def prompt_text(self, ids: list[int]) -> str:
        """The text to send an upstream that adds its own BOS: what `render` encoded,
        else the ids decoded (a client's token-id prompt); without a leading BOS."""
        with self._lock:
            text = self._texts.get(_key(ids))
        if text is None:
            bos = self.tokenizer.bos_token_id
            text = self.tokenizer.decode(ids[1:] if ids and ids[0] == bos else ids)
        return text.removeprefix(self.bos_token) if self.bos_token else text

    def count(self, text: str) -> int:
        """Tokens in generated text (for usage when the upstream reports none)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0


def _key(ids: list[int]) -> bytes:
    return hashlib.blake2b(array.array("q", ids).tobytes(), digest_size=16).digest()


def load_tokenizer(path: str) -> RemoteTokenizer:
    """The tokenizer at `path`, loaded once per process (replicas share it). Blocking:
    call it in a thread. OSError or ValueError when it cannot be loaded."""
    with _load_lock:
        return _load(os.path.abspath(path))


@functools.cache
def _load(path: str) -> RemoteTokenizer:
    from transformers import AutoTokenizer  # heavy: only for entries that need it

    if os.path.isdir(path):
        config = Path(path) / "config.json"
        model_type = (
            json.loads(config.read_text()).get("model_type", "") if config.is_file() else ""
        )
        return RemoteTokenizer(AutoTokenizer.from_pretrained(path), model_type)
    if not os.path.isfile(path):
        raise OSError(f"tokenizer {path!r} is neither a directory nor a file")
    architecture = gguf_architecture(path)
    cached = _cache_dir(path)
    if not (cached / "tokenizer_config.json").is_file():
        directory, name = os.path.split(path)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        work = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
        tokenizer.save_pretrained(work)
        try:
            os.replace(work, cached)  # atomic: a half-written cache is never found
        except OSError:  # another process converted it first
            shutil.rmtree(work, ignore_errors=True)
    return RemoteTokenizer(AutoTokenizer.from_pretrained(cached), architecture)


def _cache_dir(path: str) -> Path:
    """Where the converted tokenizer of a GGUF file lives: keyed by the file's path, size
    and mtime (hashing a multi-GB file on every start would cost more than it saves)."""
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    base = os.environ.get("KVGATE_CACHE_DIR") or Path.home() / ".cache" / "kvgate"
    root = Path(base) / "tokenizers"
    root.mkdir(parents=True, exist_ok=True)
    return root / key


def gguf_architecture(path: str) -> str:
    """`general.architecture` from a GGUF file's header ("" if absent); ValueError if the
    file is not GGUF."""
    with open(path, "rb") as f:
        magic, _version, _tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            raise ValueError(f"tokenizer {path!r} is not a GGUF file or a directory")
        for _ in range(n_kv):
            key = _gguf_string(f)
            (kind,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and kind == _GGUF_STRING:
                return _gguf_string(f)
            _gguf_skip(f, kind)
    return ""


def _gguf_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", "replace")


def _gguf_skip(f: BinaryIO, kind: int) -> None:
    if kind == _GGUF_STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, os.SEEK_CUR)
    elif kind == _GGUF_ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _gguf_skip(f, item)
    elif kind in _GGUF_SIZES:
        f.seek(_GGUF_SIZES[kind], os.SEEK_CUR)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")
