"""What a models directory holds: each `.gguf` file in it (not below), by its name less
the suffix, served by llama.cpp, and each Hugging Face model directory in it (one with a
`config.json`), by its name, served by the gpu backend (kvgate's PyTorch engine); each
with its size and modification time. A directory is outside input: it is
read to at most MAX_FILES entries, and a stem that could not be a model's name (over
MAX_NAME_CHARS, a control character, a `:` that Ollama's tags would split, a leading
dot) is left out, logged once, never served. A GGUF split into parts (`-00001-of-00003`)
is one model, served from its first part as llama.cpp loads it.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger("kvgate")
SUFFIX = ".gguf"
CONFIG = "config.json"  # what makes a directory a Hugging Face model's
MAX_FILES = 4096  # directory entries read at most
MAX_NAME_CHARS = 100
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
_PART = re.compile(r"-(\d{5})-of-(\d{5})$")


@dataclass(frozen=True)
class Found:
    """One model file of the directory."""

    name: str  # the served model's id: the file's stem
    path: str
    size: int  # bytes, of all its parts (a directory: of its files)
    modified: float
    kind: str = "local"  # the backend: local (a GGUF, llama.cpp) or gpu (a HF directory)


def scan(directory: str) -> dict[str, Found]:
    """The directory's models by name; OSError if it cannot be read."""
    files: dict[str, os.DirEntry] = {}
    dirs: list[os.DirEntry] = []
    with os.scandir(directory) as it:
        for i, entry in enumerate(it):
            if i >= MAX_FILES:
                log.warning("models directory %s: only its first %d entries read", directory, i)
                break
            if entry.name.endswith(SUFFIX) and entry.is_file():
                files[entry.name] = entry
            elif entry.is_dir() and os.path.isfile(os.path.join(entry.path, CONFIG)):
                dirs.append(entry)
    found: dict[str, Found] = {}
    for entry in dirs:
        if _named(directory, entry.name):
            found[entry.name] = _hf_directory(entry)
    for filename in sorted(files):
        stem = filename[: -len(SUFFIX)]
        part = _PART.search(stem)
        if part is not None and part[1] != "00001":
            continue  # a later part: its first part is the model
        name = stem[: part.start()] if part else stem
        if name in found or not _named(directory, name):
            continue
        parts = [files[filename]]
        if part is not None:
            count = int(part[2])
            names = [f"{name}-{i:05d}-of-{count:05d}{SUFFIX}" for i in range(1, count + 1)]
            parts = [files[n] for n in names if n in files]
        stats = [p.stat() for p in parts]
        size = sum(s.st_size for s in stats)
        found[name] = Found(name, files[filename].path, size, stats[0].st_mtime)
    return found


def _named(directory: str, name: str) -> bool:
    """Whether `name` can be a served model's; logged where it cannot."""
    if len(name) <= MAX_NAME_CHARS and NAME.fullmatch(name):
        return True
    log.warning("models directory %s: %r is not a model name; not served", directory, name[:200])
    return False


def _hf_directory(entry: os.DirEntry) -> Found:
    """A Hugging Face model's directory: its files' sizes (its first MAX_FILES)."""
    with os.scandir(entry.path) as inside:
        files = [f for f in itertools.islice(inside, MAX_FILES) if f.is_file()]
        size = sum(f.stat().st_size for f in files)
    modified = os.stat(os.path.join(entry.path, CONFIG)).st_mtime
    return Found(entry.name, entry.path, size, modified, "gpu")
