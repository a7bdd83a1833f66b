"""Pipeline parallelism's stages: which contiguous layers each stage holds, how a model
is cut down to them before any memory is given to it, and one stage's part of a forward.

A stage holds its layers (and so only their KV cache), the token embedding on the first
stage, the final norm and the LM head on the last (with a tied head, the last stage
keeps the embedding's table too: it is the head's weight). The layers it does not hold
become MissingLayer placeholders, so layer i keeps its index (and its checkpoint name)
on every stage. Ranks are numbered stage by stage: rank = stage * tp_size + tp_rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Stage:
    index: int  # this stage, 0-based
    count: int  # pipeline_parallel_size
    start: int  # its first layer
    stop: int  # one past its last layer

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @classmethod
    def of(cls, num_layers: int, count: int, index: int) -> Stage:
        """Stage `index` of `count` over `num_layers` layers, as even as can be (the
        first stages take one more where they do not divide)."""
        check_stages(num_layers, count)
        size, extra = divmod(num_layers, count)
        start = index * size + min(index, extra)
        return cls(index, count, start, start + size + (1 if index < extra else 0))


WHOLE_MODEL = Stage(0, 1, 0, 1 << 30)  # a single stage: every layer


def check_stages(num_layers: int, count: int) -> None:
    if count > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {count} exceeds the model's {num_layers} layers: "
            "every stage needs at least one"
        )


def stage_of_rank(rank: int, tp_size: int) -> tuple[int, int]:
    """(stage, tensor-parallel rank) of global rank `rank`."""
    return divmod(rank, tp_size)


class MissingLayer(nn.Module):
    """A layer another stage holds: no parameters, never run."""

    def forward(self, *args):
        raise RuntimeError("a layer of another pipeline stage was run")


def prune_to_stage(model: nn.Module, stage: Stage) -> list[str]:
    """Cut `model` (on the meta device) down to what `stage` holds; return the
    checkpoint name prefixes of what it dropped, which the loader then never reads."""
    inner = model.model
    if not hasattr(inner, "embed"):
        raise ValueError(f"{type(model).__name__} does not support pipeline_parallel_size > 1")
    dropped = []
    for i in range(len(inner.layers)):
        if not stage.start <= i < stage.stop:
            inner.layers[i] = MissingLayer()
            dropped.append(f"model.layers.{i}.")
    tied = model.lm_head.weight is inner.embed_tokens.weight
    if not stage.last:
        model.lm_head = None
        inner.norm = None
        dropped += ["lm_head.", "model.norm."]
    if not stage.first and not (stage.last and tied):
        inner.embed_tokens = None
        dropped.append("model.embed_tokens.")
    # multimodal checkpoints name the text tower's tensors so (loader.load_weights)
    dropped += [f"model.language_model.{p[len('model.') :]}" for p in dropped if p[:6] == "model."]
    return dropped


def stage_forward(
    model: nn.Module,
    stage: Stage,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta,
    hidden: torch.Tensor | None,
) -> torch.Tensor:
    """This stage's part of the model's forward: from the token ids on the first stage,
    else from the previous stage's `hidden`; the final norm's output on the last stage,
    else the hidden states the next stage takes."""
    inner = model.model
    x = inner.embed(input_ids) if stage.first else hidden
    for layer in inner.layers[stage.start : stage.stop]:
        x = layer(positions, x, meta)
    return inner.norm(x) if stage.last else x
