"""How an embedding model turns its hidden states into one vector per input, as its
sentence-transformers configuration says: modules.json lists the modules (the
transformer, a Pooling module, a Normalize module or not), 1_Pooling/config.json the
pooling mode (mean, cls or lasttoken), sentence_bert_config.json the longest input.

The engine computes exactly what sentence-transformers computes for these modules, so
a model gives the same vectors from kvgate as from its own library. A module or mode
kvgate does not implement (Dense, max pooling, ...) is refused when the model loads,
never skipped: a silently different vector would be worse than none.

`dimensions` (Matryoshka truncation) keeps the first n values and normalizes again;
only a model trained for it may be truncated: one whose config_sentence_transformers.json
lists `matryoshka_dimensions`, or a Qwen3 decoder with last-token pooling
(Qwen3-Embedding, trained with MRL; its files do not say so).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_api.errors import BadRequestError

MEAN, CLS, LAST = "mean", "cls", "lasttoken"
# 1_Pooling/config.json's flag -> mode
POOLING_FLAGS = {
    "pooling_mode_mean_tokens": MEAN,
    "pooling_mode_cls_token": CLS,
    "pooling_mode_lasttoken": LAST,
}
UNSUPPORTED_FLAGS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
# model types whose last-token-pooled models are trained with MRL (Qwen3-Embedding)
MRL_DECODERS = ("qwen3",)


@dataclass(frozen=True)
class EmbeddingSpec:
    """What a sentence-transformers model's files say about its vectors."""

    pooling: str  # MEAN, CLS or LAST
    normalize: bool
    size: int  # the vector's length (the pooled hidden size)
    max_seq_length: int | None  # the longest input it takes, if it says
    truncatable: bool  # whether `dimensions` may shorten the vector
    lowercase: bool = False  # sentence-transformers lowercases text before tokenizing


def _read_json(path: str) -> dict | list:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def is_embedding_model(path: str) -> bool:
    """Whether the directory holds a sentence-transformers model (modules.json)."""
    return os.path.isfile(os.path.join(path, "modules.json"))


def transformer_path(path: str) -> str:
    """The directory of the model's Transformer module (its config.json, weights and
    tokenizer): the model's own directory, or a subdirectory in older layouts."""
    modules = sorted(_read_json(os.path.join(path, "modules.json")), key=lambda m: m["idx"])
    return os.path.join(path, modules[0]["path"]) if modules else path


def read_embedding_spec(path: str, hf_config) -> EmbeddingSpec:
    """The model's pooling, normalization, longest input and truncatability;
    NotImplementedError for a module or mode kvgate does not run."""
    modules = _read_json(os.path.join(path, "modules.json"))
    kinds = [m["type"].rpartition(".")[2] for m in sorted(modules, key=lambda m: m["idx"])]
    if not kinds or kinds[0] != "Transformer":
        raise NotImplementedError(f"{path}: the first module must be a Transformer, got {kinds}")
    rest = kinds[1:]
    if rest not in (["Pooling"], ["Pooling", "Normalize"]):
        raise NotImplementedError(
            f"{path}: kvgate runs a Transformer, a Pooling and optionally a Normalize "
            f"module; this model has {kinds}"
        )
    pooling_dir = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
    pooling_config = _read_json(os.path.join(path, pooling_dir, "config.json"))
    pooling = _pooling_mode(path, pooling_config)
    size = pooling_config.get("word_embedding_dimension", hf_config.hidden_size)
    st_path = os.path.join(transformer_path(path), "sentence_bert_config.json")
    st_config = _read_json(st_path) if os.path.isfile(st_path) else {}
    return EmbeddingSpec(
        pooling,
        normalize=rest[-1] == "Normalize",
        size=size,
        max_seq_length=st_config.get("max_seq_length"),
        truncatable=_truncatable(path, hf_config, pooling),
        lowercase=bool(st_config.get("do_lower_case")),
    )


def _pooling_mode(path: str, config: dict) -> str:
    unsupported = [flag for flag in UNSUPPORTED_FLAGS if config.get(flag)]
    modes = [mode for flag, mode in POOLING_FLAGS.items() if config.get(flag)]
    if unsupported or len(modes) != 1:
        raise NotImplementedError(
            f"{path}: kvgate pools by exactly one of {sorted(POOLING_FLAGS.values())}; "
            f"this model sets {[f for f, v in config.items() if f.startswith('pooling_mode') and v]}"
        )
    return modes[0]


def _truncatable(path: str, hf_config, pooling: str) -> bool:
    st_config = os.path.join(path, "config_sentence_transformers.json")
    if os.path.isfile(st_config) and _read_json(st_config).get("matryoshka_dimensions"):
        return True
    return pooling == LAST and hf_config.model_type in MRL_DECODERS


def pool(hidden: torch.Tensor, lens: list[int], mode: str) -> torch.Tensor:
    """[B, H] float32 vectors of the inputs whose hidden states lie one after another in
    `hidden` [sum(lens), H]: the mean of each input's rows, its first row or its last."""
    hidden = hidden.float()
    if mode == MEAN:
        return torch.stack([rows.mean(0) for rows in hidden.split(lens)])
    lengths = torch.tensor(lens, device=hidden.device)
    ends = lengths.cumsum(0)
    return hidden[ends - lengths if mode == CLS else ends - 1]


def check_dimensions(spec: EmbeddingSpec, dimensions: int | None) -> None:
    """BadRequestError unless the model gives vectors of `dimensions` values."""
    if dimensions is None or dimensions == spec.size:
        return
    if not spec.truncatable:
        raise BadRequestError(
            f"this model's vectors have {spec.size} dimensions and it is not trained to be "
            f"shortened: `dimensions` must be {spec.size} or omitted, got {dimensions}"
        )
    if not 1 <= dimensions <= spec.size:
        raise BadRequestError(f"`dimensions` must be in [1, {spec.size}], got {dimensions}")


def finish(vectors: torch.Tensor, spec: EmbeddingSpec, dimensions: int | None) -> torch.Tensor:
    """The pooled vectors as the model gives them (normalized if it says so), truncated
    to `dimensions` where asked (check_dimensions first) and then normalized again."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return F.normalize(vectors, p=2, dim=1) if spec.normalize else vectors
