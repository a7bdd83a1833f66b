"""What Ollama's /api/tags, /api/ps and /api/show say about a served model: its file's
size, a digest, its details (format, family, quantization as far as the file's name
says it), `model_info` (architecture and context length) and its capabilities.

A configured model is loaded at start and never expires; a models directory's
(gateway.ondemand) is listed from the start, and what is not loaded yet is described
from its GGUF file's header (its architecture) without loading it. The digest is the sha256 of what
names the model's file (its path, size and modification time, or the entry's backend
and model where there is no file): stable while the file is, not a hash of its bytes,
which would read gigabytes on every listing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gateway.backends import EMBED, Backend, ModelCard
from gateway.backends.base import ChatTemplateBackend
from gateway.backends.capabilities import supports
from gateway.backends.default_model import default_model_path, model_path
from gateway.schemas.ollama import LATEST
from gateway.serving.parser_choice import parsers_of, spec_of
from gateway.state import GatewayState

# a GGUF's quantization as its file name usually says it (Q4_K_M, IQ2_XS, F16, BF16)
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d[A-Z0-9_]*|BF16|F16|F32)(?![A-Za-z0-9])", re.I)
_IN_PROCESS = ("local", "gpu")
# a model that never unloads: Ollama's clients read a time, so a far one (Ollama's own)
NEVER = "2318-01-01T00:00:00Z"
MAX_CONFIG_BYTES = 1 << 20  # a config.json read to describe an unloaded model, at most


@dataclass
class Described:
    """One served model as Ollama's API shows it."""

    card: ModelCard
    backend: Backend | None
    kind: str  # the entry's type: local, gpu, remote, fake
    path: str | None  # its file or directory, where kvgate loads one
    size: int
    modified: float
    arch: str | None = None  # an unloaded model's, from its file's header

    @property
    def name(self) -> str:
        return self.card.id + LATEST

    @property
    def digest(self) -> str:
        named = f"{self.card.id}\0{self.kind}\0{self.path}\0{self.size}\0{self.modified}"
        return hashlib.sha256(named.encode()).hexdigest()

    @property
    def architecture(self) -> str:
        if self.arch is not None:
            return self.arch
        if self.backend is not None and supports(self.backend, ChatTemplateBackend):
            _, archs, model_type = self.backend.chat_template_info()
            if model_type or archs:
                return (model_type or archs[0]).lower()
        return self.kind

    def details(self) -> dict[str, Any]:
        gguf = self.path is not None and self.path.endswith(".gguf")
        fmt = "gguf" if gguf else ("safetensors" if self.path else self.kind)
        quant = _QUANT.search(os.path.basename(self.path or ""))
        arch = self.architecture
        return {
            "parent_model": "",
            "format": fmt,
            "family": arch,
            "families": [arch],
            "parameter_size": "",
            "quantization_level": quant.group(1).upper() if quant else "",
        }

    def tag(self) -> dict[str, Any]:
        """An entry of /api/tags."""
        return {
            "name": self.name,
            "model": self.name,
            "modified_at": _time(self.modified),
            "size": self.size,
            "digest": self.digest,
            "details": self.details(),
        }

    def running(self, expires_at: float | None = None) -> dict[str, Any]:
        """An entry of /api/ps; `expires_at` (wall clock) None: never."""
        expires = NEVER if expires_at is None else _time(expires_at)
        entry = self.tag() | {"expires_at": expires, "size_vram": 0}
        entry["context_length"] = self.card.context_length
        del entry["modified_at"]
        return entry

    def capabilities(self, gw: GatewayState) -> list[str]:
        if self.card.task == EMBED:
            return ["embedding"]
        # every generate model takes tools: one with no parser of its own is prompted
        # for the hermes format (gateway.backends.tool_prompt)
        found = ["completion", "tools"]
        if self.card.vision:
            found.append("vision")
        if self.backend is not None and parsers_of(gw, self.backend).reasoning:
            found.append("thinking")
        return found

    def show(self, gw: GatewayState) -> dict[str, Any]:
        """/api/show's answer."""
        arch = self.architecture
        info: dict[str, Any] = {
            "general.architecture": arch,
            f"{arch}.context_length": self.card.context_length,
        }
        if self.card.embedding_size is not None:
            info[f"{arch}.embedding_length"] = self.card.embedding_size
        template = None
        if self.backend is not None and supports(self.backend, ChatTemplateBackend):
            template = self.backend.chat_template_info()[0]
        return {
            "license": "",
            "modelfile": "",
            "parameters": "",
            "template": template or "",
            "details": self.details(),
            "model_info": info,
            "capabilities": self.capabilities(gw),
            "modified_at": _time(self.modified),
        }


async def describe(gw: GatewayState, card: ModelCard) -> Described:
    """The card's model: its file's size and time are read off the event loop."""
    backend = next((b for b in gw.backends if b.name == card.backend), None)
    spec = None if backend is None else spec_of(gw, backend)
    kind = spec.type if spec is not None else "unknown"
    path = None
    if spec is not None and spec.type in _IN_PROCESS:
        path = await asyncio.to_thread(_path_of, spec.model)
    size, modified = await asyncio.to_thread(_stat, path, gw.traffic.started_at)
    arch = None
    models = gw.models_dir
    if path is not None and models is not None and not models.is_up(card.id):
        arch = await asyncio.to_thread(_architecture, path)
    return Described(card, backend, kind, path, size, modified, arch)


def _path_of(model: str) -> str | None:
    try:
        return model_path(model) if model else str(default_model_path())
    except Exception:  # a model that serves has its file; a listing must not fail on one
        return None


def _architecture(path: str) -> str:
    """An unloaded model's architecture, from its GGUF's header or its config.json."""
    try:
        if path.endswith(".gguf"):
            # lazily: a gateway without a GGUF never loads llama.cpp
            from backend_local.gguf_header import read_strings

            return read_strings(path, {"general.architecture"}).get("general.architecture", "")
        with open(os.path.join(path, "config.json"), "rb") as f:
            config = json.loads(f.read(MAX_CONFIG_BYTES))
        archs = config.get("architectures") or [""]
        return str(config.get("model_type") or archs[0]).lower()
    except (OSError, ValueError, AttributeError):  # a model that does not load says so then
        return ""


def _stat(path: str | None, started_at: float) -> tuple[int, float]:
    if path is None or not os.path.exists(path):
        return 0, started_at
    if os.path.isfile(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    sizes = [os.stat(f).st_size for f in files if os.path.isfile(f)]
    return sum(sizes), os.stat(path).st_mtime


def _time(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
