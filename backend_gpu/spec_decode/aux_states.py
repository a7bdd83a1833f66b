"""The target's hidden states at a few layers, kept from the step that computes them
anyway (an EAGLE-3 head reads three layers' inputs: no extra pass).

A forward pre-hook on each chosen layer copies the layer's input into one buffer, the
layers side by side ([tokens, 3H]). A copy, not a reference: on CUDA the copy is
recorded into the decode graphs with the rest of the step, so a replayed step fills
the buffer as an eager one does. The buffer grows to the largest step it sees; the
memory profile runs the largest step before any graph is captured.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


class AuxStates:
    def __init__(self, layers: list[nn.Module], hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self.width = len(layers) * hidden_size
        self.buffer = torch.empty(0)
        for j, layer in enumerate(layers):
            layer.register_forward_pre_hook(functools.partial(self._keep, j))

    @classmethod
    def install(cls, model: nn.Module, layer_ids: tuple[int, ...], hidden_size: int):
        """Hooks on `model`'s decoder layers `layer_ids`; None when there are none."""
        if not layer_ids:
            return None
        layers = model.model.layers
        return cls([layers[i] for i in layer_ids], hidden_size)

    def _keep(self, j: int, module: nn.Module, args: tuple) -> None:
        x = args[1]  # a decoder layer's (positions, hidden states, metadata)
        n = x.shape[0]
        if self.buffer.shape[0] < n or self.buffer.device != x.device:
            self.buffer = x.new_empty(n, self.width)
        h = self.hidden_size
        self.buffer[:n, j * h : (j + 1) * h].copy_(x)

    def rows(self, num_tokens: int) -> torch.Tensor:
        """The last step's rows [num_tokens, 3H], in the step's token order (a view:
        valid until the next step)."""
        return self.buffer[:num_tokens]
