"""A model's own sampling defaults: what a request that leaves temperature, top_p, top_k,
min_p or repetition_penalty out is sampled with.

vLLM takes them from the model's generation_config.json (`--generation-config auto`)
and Ollama from the Modelfile: a model tuned to be sampled at 0.6 and served at the
API's 1.0 answers worse than it can, and a 135M chat model at 1.0 answers noise. The
sources, the later overriding the earlier: the model's own (a Hugging Face directory's
generation_config.json; a GGUF file's `general.sampling.*` keys, as llama.cpp writes
them), the packaged default model's (its model card's advice), then the `[[backends]]`
entry's `generation_config` table (vLLM's --override-generation-config). A value out
of range in a model's file is left out; one in the config is refused at start.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 64 * 1024  # a generation_config.json is a few hundred bytes

# each key: whether a value is in range (the request schema's own bounds)
_IN_RANGE: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: 0 <= v <= 2,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v == -1 or (v >= 1 and v == int(v)),
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: 0 < v <= 10,
}
SAMPLING_KEYS = tuple(_IN_RANGE)
# llama.cpp's GGUF keys (LLM_KV_GENERAL_SAMPLING_*) for the same options
_GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
}


def checked(values: Mapping[str, Any], where: str) -> dict[str, float]:
    """`values` as sampling defaults; ValueError naming `where` and the key for an
    unknown key or a value out of range (a config's table)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if key not in _IN_RANGE:
            raise ValueError(f"{where}: unknown key {key!r}; known: {', '.join(SAMPLING_KEYS)}")
        if not _valid(key, value):
            raise ValueError(f"{where}: {key} = {value!r} is out of range")
        out[key] = _typed(key, value)
    return out


def from_hf_dir(path: str) -> dict[str, float]:
    """The sampling keys of `path`/generation_config.json, when the file is there; a
    file that is too large, not JSON or out of range gives what is valid in it."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file) or os.path.getsize(file) > MAX_FILE_BYTES:
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        log.warning("%s is not readable JSON; its sampling defaults are not used", file)
        return {}
    if not isinstance(data, dict) or data.get("do_sample") is False:
        return {}  # greedy by the file's own word: the API's defaults stand
    return _valid_only(data, file)


def from_gguf(meta: Callable[[str], str | None]) -> dict[str, float]:
    """The `general.sampling.*` values of a GGUF file (`meta` reads a key as text)."""
    values: dict[str, Any] = {}
    for key, gguf_key in _GGUF_KEYS.items():
        text = meta(gguf_key)
        if text is not None:
            try:
                values[key] = float(text)
            except ValueError:
                continue
    return _valid_only(values, "the GGUF file")


def _valid_only(data: Mapping[str, Any], where: str) -> dict[str, float]:
    out = {}
    for key in SAMPLING_KEYS:
        if key in data:
            if _valid(key, data[key]):
                out[key] = _typed(key, data[key])
            else:
                log.warning("%s: %s = %r is out of range; not used", where, key, data[key])
    return out


def _valid(key: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and _IN_RANGE[key](value)


def _typed(key: str, value: float) -> float:
    return int(value) if key == "top_k" else float(value)
