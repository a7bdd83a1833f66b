"""Random EAGLE-3 heads for the tiny models, written in the published layout by the
trainer's own writer (studies/eagle3_ttt.py), and the published variants of it."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from studies.eagle3_ttt import Eagle3TTT, head_config, save_head


def write_random_head(
    target: str,
    directory: str,
    draft_ids: list[int] | None = None,
    aux_layers: tuple[int, ...] = (0, 1, 1),
    nested: bool = False,
    seed: int = 0,
) -> str:
    """A seeded random head for the model at `target`; `draft_ids`: its draft
    vocabulary (None: the whole one)."""
    config = AutoConfig.from_pretrained(target)
    config = getattr(config, "text_config", None) or config
    ids = torch.tensor(sorted(draft_ids) if draft_ids else range(config.vocab_size))
    torch.manual_seed(seed)
    embed = torch.randn(config.vocab_size, config.hidden_size)
    head = Eagle3TTT(head_config(config, len(ids), list(aux_layers), nested), embed)
    with torch.no_grad():  # norms away from 1, so that a misplaced one shows
        for param in head.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
    save_head(directory, head, ids, config.vocab_size)
    return directory


def edit_tensors(directory: str, change) -> None:
    """Rewrite the head's safetensors with `change(tensors) -> tensors`."""
    path = os.path.join(directory, "model.safetensors")
    tensors = change(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(directory: str, **changes) -> None:
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
