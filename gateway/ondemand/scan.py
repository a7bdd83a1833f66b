"""What a models directory holds: each `.gguf` file in it, by its name less the suffix,
and each subdirectory holding GGUF files (llama.cpp's router's layout for a model of
several files), by the subdirectory's name, served by llama.cpp; and each Hugging Face
model directory in it (one with a `config.json`), by its name, served by the gpu backend
(kvgate's PyTorch engine); each with its size and modification time. A directory is
outside input: it is read to at most MAX_FILES entries, and a name that could not be a
model's (over MAX_NAME_CHARS, a control character, a `:` that Ollama's tags would split,
a leading dot) is left out, logged once, never served. A GGUF split into parts
(`-00001-of-00003`) is one model, served from its first part as llama.cpp loads it.

A vision projector (a GGUF whose name holds `mmproj`, llama.cpp's router's rule, or
whose header's general.architecture is `clip`) is never a model of its own, as neither
Ollama nor llama-server lists one: it goes with the model beside it, which then loads
with it (the llama.cpp backend's `mmproj`) and takes images. Its pairs: a subdirectory
holding one model (a file, or one split into parts) and one projector, as llama-server's
router reads one; and, directly in the directory, `NAME.gguf` with `mmproj-NAME.gguf`
or `NAME.mmproj.gguf`. A projector that pairs with nothing, or a subdirectory holding
more than one model or projector, is logged once and not served.
"""

from __future__ import annotations

import functools
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
PROJECTOR = "mmproj"  # in a file's name: a vision projector (llama-server's router's rule)
CLIP = "clip"  # a projector's general.architecture, as llama.cpp's converter writes it
HEADER_KEYS = 16  # general.architecture leads a GGUF's keys: read no further for it


@dataclass(frozen=True)
class Found:
    """One model of the directory."""

    name: str  # the served model's id: the file's stem, or its subdirectory's name
    path: str
    size: int  # bytes, of all its parts and its projector (a directory: of its files)
    modified: float  # the latest of its files' (a projector replaced reloads the model)
    kind: str = "local"  # the backend: local (a GGUF, llama.cpp) or gpu (a HF directory)
    mmproj: str | None = None  # its vision projector's GGUF, loaded with it


def scan(directory: str) -> dict[str, Found]:
    """The directory's models by name; OSError if it cannot be read."""
    files: dict[str, os.DirEntry] = {}
    dirs: list[os.DirEntry] = []
    subdirs: list[os.DirEntry] = []
    with os.scandir(directory) as it:
        for i, entry in enumerate(it):
            if i >= MAX_FILES:
                log.warning("models directory %s: only its first %d entries read", directory, i)
                break
            if entry.name.endswith(SUFFIX) and entry.is_file():
                files[entry.name] = entry
            elif entry.is_dir():
                config = os.path.isfile(os.path.join(entry.path, CONFIG))
                (dirs if config else subdirs).append(entry)
    found: dict[str, Found] = {}
    for entry in dirs:
        if _named(directory, entry.name):
            found[entry.name] = _hf_directory(entry)
    projectors = {n: e for n, e in files.items() if _is_projector(e)}
    models = {n: e for n, e in files.items() if n not in projectors}
    paired: set[str] = set()
    for name, parts in _models(models).items():
        if name in found or not _named(directory, name):
            continue
        pair = (f"{PROJECTOR}-{name}{SUFFIX}", f"{name}.{PROJECTOR}{SUFFIX}")
        mmproj = next((projectors[p] for p in pair if p in projectors), None)
        if mmproj is not None:
            paired.add(mmproj.name)
        found[name] = _gguf(name, parts, mmproj)
    for left in sorted(set(projectors) - paired):
        _warn_once(
            f"models directory {directory}: {left!r} is a vision projector no model pairs "
            f"with (name it {PROJECTOR}-NAME{SUFFIX} beside NAME{SUFFIX}, or put both in "
            "a subdirectory); not served"
        )
    for entry in subdirs:
        model = _gguf_directory(entry)
        if model is not None and entry.name not in found and _named(directory, entry.name):
            found[entry.name] = model
    return found


def _models(files: dict[str, os.DirEntry]) -> dict[str, list[os.DirEntry]]:
    """The models among GGUF `files` (none a projector) by name: each file by its stem,
    a split model by its stem less the part, with its parts (those there, in order)."""
    models: dict[str, list[os.DirEntry]] = {}
    for filename in sorted(files):
        stem = filename[: -len(SUFFIX)]
        part = _PART.search(stem)
        if part is None:
            models[stem] = [files[filename]]
        elif part[1] == "00001":  # a later part: its first part is the model
            name, count = stem[: part.start()], int(part[2])
            names = [f"{name}-{i:05d}-of-{count:05d}{SUFFIX}" for i in range(1, count + 1)]
            models[name] = [files[n] for n in names if n in files]
    return models


def _gguf(name: str, parts: list[os.DirEntry], mmproj: os.DirEntry | None) -> Found:
    """A llama.cpp model: its first part's path, its files' size and latest time."""
    stats = [p.stat() for p in parts]
    projector = None if mmproj is None else mmproj.path
    if mmproj is not None:
        stats.append(mmproj.stat())
    size = sum(s.st_size for s in stats)
    return Found(name, parts[0].path, size, max(s.st_mtime for s in stats), mmproj=projector)


def _gguf_directory(entry: os.DirEntry) -> Found | None:
    """A subdirectory of GGUF files as llama-server's router reads one: its one model
    (a file, or one split into parts) and at most one projector; None if it holds no
    model (another kind of directory) or is ambiguous (logged once)."""
    with os.scandir(entry.path) as inside:
        ggufs = {
            f.name: f
            for f in itertools.islice(inside, MAX_FILES)
            if f.name.endswith(SUFFIX) and f.is_file()
        }
    projectors = [e for e in ggufs.values() if _is_projector(e)]
    names = {e.name for e in projectors}
    models = _models({n: e for n, e in ggufs.items() if n not in names})
    if not models:
        return None
    if len(models) > 1 or len(projectors) > 1:
        _warn_once(
            f"models directory: {entry.path!r} holds {len(models)} models and "
            f"{len(projectors)} vision projectors (one model and at most one projector "
            "make a model's subdirectory); not served"
        )
        return None
    ((_, parts),) = models.items()
    return _gguf(entry.name, parts, projectors[0] if projectors else None)


def _is_projector(entry: os.DirEntry) -> bool:
    """A vision projector by its name, else by its header (read once per version of the
    file; a file that is no GGUF, or not yet whole, is not one)."""
    if PROJECTOR in entry.name:
        return True
    stat = entry.stat()
    return _architecture(entry.path, stat.st_size, stat.st_mtime_ns) == CLIP


@functools.lru_cache(maxsize=MAX_FILES)
def _architecture(path: str, size: int, mtime_ns: int) -> str:
    """The GGUF's general.architecture ('' where it cannot be read); its size and time
    key the cache, so a file replaced is read again."""
    from backend_local.gguf_header import read_strings  # lazily: llama.cpp's package

    key = "general.architecture"
    try:
        return read_strings(path, {key}, max_keys=HEADER_KEYS).get(key, "")
    except (OSError, ValueError):
        return ""


def _named(directory: str, name: str) -> bool:
    """Whether `name` can be a served model's; logged (once) where it cannot."""
    if len(name) <= MAX_NAME_CHARS and NAME.fullmatch(name):
        return True
    _warn_once(f"models directory {directory}: {name[:200]!r} is not a model name; not served")
    return False


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A warning about the directory, once per process (it is read every second)."""
    if message not in _warned and len(_warned) < MAX_FILES:
        _warned.add(message)
        log.warning("%s", message)


def _hf_directory(entry: os.DirEntry) -> Found:
    """A Hugging Face model's directory: its files' sizes (its first MAX_FILES)."""
    with os.scandir(entry.path) as inside:
        files = [f for f in itertools.islice(inside, MAX_FILES) if f.is_file()]
        size = sum(f.stat().st_size for f in files)
    modified = os.stat(os.path.join(entry.path, CONFIG)).st_mtime
    return Found(entry.name, entry.path, size, modified, "gpu")
